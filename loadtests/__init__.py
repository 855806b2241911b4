"""Benchmarks, load and soak runs, the simulator and the comparison with peer routers (not tests)."""
import os

# as gateway/cli.py: transformers' "PyTorch was not found" advice is noise here (tokenizers only);
# set before any benchmark imports transformers; a user's own setting wins.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
