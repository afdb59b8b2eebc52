"""Build tiny, randomly initialised transformers models for tests and demos (no hub needed).

    python -m reward_servers.tiny_models OUT_DIR [--hidden 64 --layers 2]
    python -m reward_servers.tiny_models OUT_DIR --kind tiny-seq-cls

writes OUT_DIR/seq-cls (a BERT-style sequence-classification reward model, one label) and
OUT_DIR/causal-lm (a GPT-2-style causal LM), each with `save_pretrained`, sharing a small
character-level WordPiece vocabulary written here (so nothing is downloaded); with `--kind`, only
that model, into OUT_DIR itself. A reward model declared with `build:` in the config is built
this way at its `path` the first time a deployment starts (`build_missing`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import string
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from reward_servers.backends.deps import require
from tangram_celery.common.errors import RewardServerError

if TYPE_CHECKING:
    from tangram_celery.common.config import RewardModelConfig, TangramConfig

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _vocab() -> list[str]:
    chars = string.ascii_lowercase + string.digits + string.punctuation
    words = ["the", "a", "is", "of", "and", "to", "answer", "yes", "no", "good", "bad"]
    return SPECIALS + list(chars) + [f"##{c}" for c in chars] + words


def build_tokenizer(out: Path) -> object:
    """A fast WordPiece tokenizer (BERT-style normalisation) over `_vocab()`, saved to `out`."""
    tf, tk = require("transformers"), require("tokenizers")
    vocab = {t: i for i, t in enumerate(_vocab())}
    tok = tk.Tokenizer(tk.models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=200))
    tok.normalizer = tk.normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tok.post_processor = tk.processors.BertProcessing(("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"]))
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def build_seq_cls(out: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A random-init BERT sequence classifier with one output label (a reward head) at `out`."""
    torch, tf = require("torch"), require("transformers")
    torch.manual_seed(seed)
    build_tokenizer(out)
    cfg = tf.BertConfig(
        vocab_size=len(_vocab()),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        intermediate_size=hidden * 2,
        max_position_embeddings=1024,
        num_labels=1,
    )
    tf.BertForSequenceClassification(cfg).save_pretrained(out)
    return out


def build_causal_lm(out: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A random-init GPT-2 causal LM at `out`."""
    torch, tf = require("torch"), require("transformers")
    torch.manual_seed(seed)
    tok = build_tokenizer(out)
    cfg = tf.GPT2Config(
        vocab_size=len(_vocab()),
        n_embd=hidden,
        n_layer=layers,
        n_head=max(1, hidden // 32),
        n_positions=1024,
        pad_token_id=tok.pad_token_id,  # type: ignore[attr-defined]
        bos_token_id=tok.cls_token_id,  # type: ignore[attr-defined]
        eos_token_id=tok.sep_token_id,  # type: ignore[attr-defined]
    )
    tf.GPT2LMHeadModel(cfg).save_pretrained(out)
    return out


def build_all(out: Path, hidden: int = 64, layers: int = 2) -> dict[str, Path]:
    """Both tiny models under `out`; returns {'seq-cls': dir, 'causal-lm': dir}."""
    return {
        "seq-cls": build_seq_cls(out / "seq-cls", hidden, layers),
        "causal-lm": build_causal_lm(out / "causal-lm", hidden, layers),
    }


BUILDERS: dict[str, Callable[[Path, int, int], Path]] = {
    "tiny-seq-cls": build_seq_cls,
    "tiny-causal-lm": build_causal_lm,
}


def build_into(kind: str, out: Path, hidden: int = 64, layers: int = 2) -> Path:
    """Build a model of `kind` at `out`, atomically: it is written next to `out` and renamed, so
    an interrupted build never leaves a directory that looks like a model. A model already at
    `out` (another builder won the race) is kept."""
    tmp = out.with_name(f".{out.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    BUILDERS[kind](tmp, hidden, layers)
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def missing_builds(cfg: TangramConfig) -> list[RewardModelConfig]:
    """Reward models declared with `build:` whose `path` holds no model yet (imports no torch)."""
    return [
        m for m in cfg.reward_models if m.build and m.path and not (Path(m.path) / "config.json").exists()
    ]


def build_missing(cfg: TangramConfig, say: Callable[[str], object] = print) -> list[Path]:
    """Build every missing `build:` model, each in a subprocess (torch stays out of the caller's
    memory); returns the directories built. Raises RewardServerError with the builder's output."""
    built = []
    for m in missing_builds(cfg):
        assert m.path is not None and m.build is not None
        out = Path(m.path).resolve()
        say(f"building the {m.build} reward model {m.name!r} into {out} (once; nothing is downloaded) ...")
        out.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [sys.executable, "-m", "reward_servers.tiny_models", str(out), "--kind", m.build],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise RewardServerError(
                f"building reward model {m.name!r} ({m.build}) failed:\n{proc.stderr[-2000:]}"
            )
        built.append(out)
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reward_servers.tiny_models", description=__doc__)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--hidden", type=int, default=64, help="hidden size")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers")
    ap.add_argument("--kind", choices=sorted(BUILDERS), help="build only this model, into OUT_DIR itself")
    args = ap.parse_args(argv)
    if args.kind:
        print(f"{args.kind}: {build_into(args.kind, args.out_dir, args.hidden, args.layers)}")
        return 0
    for kind, path in build_all(args.out_dir, args.hidden, args.layers).items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
