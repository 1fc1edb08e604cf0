# Source from the repository root on a GPU machine: installs the wheels in .whl/ into /tmp/site and
# puts them and the checkout on PYTHONPATH. Then, for example:
#   python3 -m benchmarks.decode --quick
#   python3 -m pytest -q tests/gpu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD && export PYTHONUNBUFFERED=1
