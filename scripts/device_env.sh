# Source on the H200 device machine: installs carried wheels (.whl/) and puts the checkout on sys.path.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD && export PYTHONUNBUFFERED=1
