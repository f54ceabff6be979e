"""The ctypes structs match what a C compiler makes of include/moefuse.h."""

import ctypes
import os
import shutil
import subprocess

import pytest

from moefuse import _capi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER_DIR = os.path.join(ROOT, "include")

# C type -> (ctypes struct, fields)
STRUCTS = {
    "moefuse_tensor": (_capi.Tensor, ["data", "offset", "dtype", "rank", "shape", "stride"]),
    "moefuse_quant_options": (_capi.QuantOptions, ["group_size", "scale_layout", "ue8m0", "eps"]),
    "moefuse_act_options": (_capi.ActOptions, ["activation", "order", "limit", "intermediate",
                                                "alpha", "up_offset", "reserved"]),
    "moefuse_act_quant_options": (_capi.ActQuantOptions, ["act", "quant", "zero_tail"]),
    "moefuse_moe_options": (_capi.MoeOptions, ["activation", "order", "limit", "alpha",
                                               "up_offset", "reserved"]),
    "moefuse_fp8_moe_options": (_capi.Fp8MoeOptions, ["moe", "act", "reserved"]),
    "moefuse_routing": (_capi.Routing, ["topk_ids", "topk_weights", "expert_map", "n_shared",
                                        "shared_scale", "shared_weights"]),
    "moefuse_routing_meta": (_capi.RoutingMeta, ["counts", "offsets", "order", "position",
                                                 "masked_row"]),
    "moefuse_router_options": (_capi.RouterOptions, ["scoring", "n_group", "topk_group",
                                                     "group_scoring", "renormalize", "scale",
                                                     "reserved"]),
}


def _c_layout(tmp_path):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc or not os.path.exists(os.path.join(HEADER_DIR, "moefuse.h")):
        pytest.skip("no C compiler or no include/moefuse.h (run from the repository)")
    lines = ["#include <moefuse.h>", "#include <stddef.h>", "#include <stdio.h>",
             "int main(void) {"]
    for cname, (_, fields) in STRUCTS.items():
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        for f in fields:
            lines.append(f'printf("{cname} {f} %zu\\n", offsetof({cname}, {f}));')
    lines.append('printf("enum sizeof %zu\\n", sizeof(moefuse_dtype));')
    lines.append("return 0; }")
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text("\n".join(lines))
    subprocess.run([cc, "-std=c11", "-I", HEADER_DIR, str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()}


def test_struct_layout_matches_the_header(tmp_path):
    c = _c_layout(tmp_path)
    assert c[("enum", "sizeof")] == ctypes.sizeof(_capi.moefuse_enum)
    for cname, (struct, fields) in STRUCTS.items():
        assert c[(cname, "sizeof")] == ctypes.sizeof(struct), cname
        for f in fields:
            assert c[(cname, f)] == getattr(struct, f).offset, f"{cname}.{f}"


def test_enum_names_match_the_library():
    lib = _capi.lib
    for code, name in enumerate(_capi.STATUS_NAMES):
        assert _capi.text(lib.moefuse_status_name(code)) == name
    for code, name in enumerate(_capi.DTYPE_NAMES):
        assert _capi.text(lib.moefuse_dtype_name(code)) == name
        assert lib.moefuse_dtype_size(code) == _capi.DTYPE_SIZES[name]
