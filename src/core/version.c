/* The library's version, as its build saw the header (include/moefuse.h). */
#include "moefuse.h"

unsigned moefuse_version(void) { return MOEFUSE_VERSION; }
