#!/bin/sh
# Sum the "Checks: X, Failures: Y, Errors: Z" lines Check wrote into a meson
# test log and print them as one "passed, failed" line.
log="$1/meson-logs/testlog.txt"
awk '/Checks: [0-9]+, Failures: [0-9]+, Errors: [0-9]+/ {
       for (i = 1; i <= NF; i++) {
         if ($i == "Checks:")   checks   += $(i + 1)
         if ($i == "Failures:") failures += $(i + 1)
         if ($i == "Errors:")   errors   += $(i + 1)
       }
     }
     END { printf "check: %d passed, %d failed\n", checks - failures - errors, failures + errors }' "$log"
