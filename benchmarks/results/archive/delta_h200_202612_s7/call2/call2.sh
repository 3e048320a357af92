#!/usr/bin/env bash
# s7 call 2: the body under a time limit, then its results tarred (many files under $OUT get left out).
mkdir -p $OUT/r
timeout 565 bash .whl/call2_body.sh 2>&1 | tee $OUT/r/console.txt
cd $OUT && tar czf r.tgz r && rm -rf r
