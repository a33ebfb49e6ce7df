# Sourced first by every device call (run from the repo root on the GPU machine, carrying [".whl", "local"]):
# the wheels the machine lacks (../shared/device/wheels.sh built .whl/), the project from src/, the card's tag.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]*' | head -1 | tr A-Z a-z)
DATE=${DATE:-$(date +%F)}
echo "card $CARD date $DATE"
