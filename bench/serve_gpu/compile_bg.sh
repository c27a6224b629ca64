#!/usr/bin/env bash
# Every kernel variant into the NVRTC cache, detached (it outlives this device call): start it in a sitting's first
# call and the later calls find the cache filled. Its pid goes to /tmp/exl3-compile.pid and /tmp/exl3-compile.done
# marks the end; run_exactness.sh waits on those instead of compiling again. (Not pgrep -f: a waiting command line that
# names the pattern matches itself.)
set -u
rm -rf /tmp/exl3-compile-src /tmp/exl3-compile.done && cp -r src /tmp/exl3-compile-src  # later calls relay the tree
cd /tmp && XDG_CACHE_HOME=/tmp/exl3cache PYTHONPATH=/tmp/exl3-compile-src setsid nohup bash -c \
  "python3 -m exl3_vllm.kernels.cli kernels --compile-only --arch sm_90 --jobs ${JOBS:-16} > /tmp/exl3-compile.txt 2>&1; \
   echo \"kernel compile rc=\$?\" >> /tmp/exl3-compile.txt; touch /tmp/exl3-compile.done" > /dev/null 2>&1 < /dev/null &
echo $! > /tmp/exl3-compile.pid
echo "[compile_bg] started, pid $(cat /tmp/exl3-compile.pid)"
