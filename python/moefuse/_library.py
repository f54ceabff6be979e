"""Finds and loads libmoefuse, the one implementation this package calls."""

import ctypes
import ctypes.util
import glob
import os

# Set it to use a library that is not inside the package, e.g. a Meson build:
# MOEFUSE_LIBRARY=build/src/libmoefuse.so
LIBRARY_ENV = "MOEFUSE_LIBRARY"


def _candidates():
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        # Given explicitly: that file or nothing, so a typo is not hidden by a fallback.
        return [explicit]
    here = os.path.dirname(os.path.abspath(__file__))
    # pip install . puts the unversioned libmoefuse.so beside this file.
    found = sorted(glob.glob(os.path.join(here, "libmoefuse.so*")))
    found += sorted(glob.glob(os.path.join(here, "libmoefuse*.dylib")))
    system = ctypes.util.find_library("moefuse")  # after `meson install`
    if system:
        found.append(system)
    return found


def load():
    """The loaded library; OSError says where it looked."""
    tried = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path), path
        except OSError as exc:
            tried.append(f"{path}: {exc}")
    where = "; ".join(tried) if tried else "nothing found beside the package or on the system"
    raise OSError(
        f"moefuse: cannot load libmoefuse ({where}). Install the package with `pip install .` "
        f"from the repository, or set {LIBRARY_ENV} to a built library, "
        f"e.g. {LIBRARY_ENV}=build/src/libmoefuse.so")
