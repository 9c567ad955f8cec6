#!/usr/bin/env bash
# A worker that plants a fault on one campaign device only (issue 37), for
#   smallseq fuzz --backend exec --devices 0,1 --worker 'ci/fault-on-device.sh DEV VAR=VALUE BIN worker --backend B'
# The campaign starts one worker per device and tells it which in SMALLSEQ_DEVICE (and narrows
# CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES to it, so the worker itself runs on its device 0).
# On device DEV the worker gets VAR=VALUE (SMALLSEQ_KERNEL_DEFINES=SMALLSEQ_MUTANT_OOB_WRITE on a
# GPU, SMALLSEQ_MUTANT_FAULT=panic-always for a CPU worker); on every other device it runs unchanged.
set -eu
[ $# -ge 3 ] || { echo "usage: $0 DEVICE VAR=VALUE COMMAND…" >&2; exit 2; }
dev=$1 plant=$2; shift 2
case $plant in *=*) ;; *) echo "$0: '$plant' is not VAR=VALUE" >&2; exit 2 ;; esac
if [ "${SMALLSEQ_DEVICE:-}" = "$dev" ]; then
  export "${plant?}"
fi
exec "$@"
