"""What the converter tests and their fixture generators do alike with tiny Hugging Face
checkpoints: train the tiny tokenizer, copy a checkpoint with an edited config.json, and run
llama.cpp's own converter on one (tests/deepseek4_fixture.py, tests/deepseek4_official.py,
tests/fixtures/deepseek2/make_deepseek2_fixtures.py, tests/test_convert_deepseek*.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def make_bpe_tokenizer(text: list[str], vocab_size: int, special: list[str]):
    """A tiny byte-level BPE (GPT-2 pre-tokenizer regex) trained on ``text`` (eight times over),
    as a transformers fast tokenizer; ``special`` are its BOS, EOS and PAD tokens, in that order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text * 8, trainer=trainer)
    bos, eos, pad = special
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)


def edited_checkpoint(src: Path, dst: Path, cfg_update: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A checkpoint directory ``dst`` sharing src's files (symlinks) with an edited config.json:
    the keys ``drop`` removed, then ``cfg_update`` applied."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            os.symlink(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(cfg_update or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


_LLAMA_CPP_WRAPPER = r"""
import runpy, sys
sys.path.insert(0, sys.argv[1])
import conversion.base as base
# Only change: the tiny tokenizer's hash is unknown to llama.cpp; its pre-tokenizer is GPT-2's.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def run_llama_cpp_converter(llama_cpp: Path, hf_dir: Path, out: Path, *args: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py (of the source tree ``llama_cpp``) on ``hf_dir`` into
    ``out``, with ``args`` added to its command line. It runs with that tree's own gguf-py
    first on PYTHONPATH (the gguf package next to the converter knows its keys), through a
    wrapper whose only change is the pre-tokenizer name of the tiny tokenizer."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(llama_cpp / "gguf-py"), str(llama_cpp)])
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [sys.executable, "-c", _LLAMA_CPP_WRAPPER, str(llama_cpp), str(hf_dir), "--outfile", str(out), *args]
    subprocess.run(cmd, check=True, env=env)
