#!/bin/sh
# Sum the "Checks: X, Failures: Y, Errors: Z" lines Check wrote into a meson
# test log and print them as one "passed, failed" line. Programs that exited
# with 77 (a built backend without a device: "SKIP: backend X unavailable")
# are counted on the same line, with the backends they skipped; programs that
# skip by choice (the 4.3 GB case off the cuda backend) are counted apart.
log="$1/meson-logs/testlog.txt"
awk '/Checks: [0-9]+, Failures: [0-9]+, Errors: [0-9]+/ {
       for (i = 1; i <= NF; i++) {
         if ($i == "Checks:")   checks   += $(i + 1)
         if ($i == "Failures:") failures += $(i + 1)
         if ($i == "Errors:")   errors   += $(i + 1)
       }
     }
     /^result: +exit status 77$/ { skipped++ }
     /^SKIP: backend [^ ]+ unavailable/ { nodev++; if (!($3 in seen)) { seen[$3]; which = which (which ? ", " : "") $3 } }
     END {
       printf "check: %d passed, %d failed", checks - failures - errors, failures + errors
       if (skipped) {
         printf ", %d programs skipped (", skipped
         if (nodev) printf "%d for want of a device: %s", nodev, which
         if (skipped > nodev) printf "%s%d off on this backend, e.g. the 4.3 GB case", nodev ? "; " : "", skipped - nodev
         printf ")"
       }
       printf "\n"
     }' "$log"
