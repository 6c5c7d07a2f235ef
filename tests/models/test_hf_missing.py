"""Without the [hf] extra: asking for a Hugging Face model is one line with the install hint
(exit 2), and the core works. transformers is made unimportable in a fresh process, so this
runs whether or not the extra is installed (~6 s)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
sys.modules["transformers"] = None  # import transformers now raises ImportError
from fsdpkit_cli.app import app
cases = json.loads(sys.argv[1])
print(json.dumps([app(args, standalone_mode=False) for args in cases]))
"""


def test_without_transformers_hf_models_exit_2_with_the_install_hint(tmp_path):
    cases = [
        ["train", "--model", "hf:llama-tiny"],
        ["plan", "--model", "hf:gpt2-tiny", "--world-size", "2"],
        ["prepare-data", "x.txt", "x.bin", "--tokenizer", f"hf:{tmp_path}"],
        ["plan", "--model", "gpt-tiny", "--world-size", "2", "--json"],
    ]
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [2, 2, 2, 0]  # the built-in model still plans
    errors = done.stderr.splitlines()
    assert len(errors) == 3 and all(
        line.startswith("error: ") and "pip install 'fsdpkit[hf]' (transformers, tokenizers)" in line for line in errors
    ), errors
