# Sourced at the start of a device command (after scripts/device_prep.sh here, with .whl and .tok
# carried): installs the carried wheels, keeps NVLink multicast off everywhere, unbuffers Python.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 \
  | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD
# the commit the results belong to: the device's copy of .git may be stale, so write it here first
# (`git rev-parse --short HEAD > .tok/commit`) and benchmarks/common.commit() reads it from the env
[ -f .tok/commit ] && export CHATENGINE_COMMIT="$(cat .tok/commit)"
touch /tmp/mark  # results written after this are the command's: find benchmarks/results -newer /tmp/mark
nvidia-smi -L
