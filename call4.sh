#!/bin/bash
export PYTHONUNBUFFERED=1
L=$OUT/call.log
timeout 200 env NANOSERVE_MXFP4_EXPERTS=1 python benchmarks/probes/profile_decode.py --models gpt-oss-20b --ops on >> $L 2>&1; echo "rc=$?" >> $L
