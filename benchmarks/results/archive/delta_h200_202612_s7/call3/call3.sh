#!/usr/bin/env bash
# s7 call 3: the body under a time limit, then its results tarred.
mkdir -p $OUT/r
timeout 565 bash .whl/call3_body.sh 2>&1 | tee $OUT/r/console.txt
cd $OUT && tar czf r.tgz r && rm -rf r
