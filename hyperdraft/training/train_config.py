"""TrainConfig: the options of one train-draft run, checked by name before anything is loaded."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    model: str
    out: str
    prompts: str | None = None  # JSONL; None: the target writes its own
    num_samples: int = 2000  # prompts taken from the file, or written by the target without one
    self_prompts: int = 0  # with a prompts file: this many target-written prompts added after the file's
    max_len: int = 512
    epochs: int = 3
    lr: float = 1e-4  # the peak of the schedule
    draft_vocab_size: int | None = None  # None: the target's whole vocabulary
    head_intermediate_size: int | None = None  # the head's MLP width; None: the target's
    aux_layer_ids: tuple[int, ...] | None = None  # target layers whose outputs the head reads; None: SGLang's default
    ttt_steps: int = 5
    temperatures: tuple[float, ...] = (0.0,)  # of the target's answers: each prompt answered once per temperature
    resume: bool = False
    init: str | None = None  # a published head to start from (weights, draft vocabulary, aux layers, MLP width)
    device: str = "cpu"
    dtype: str = "auto"  # the target's (and the written head's) dtype
    seed: int = 0
    progress: bool = True
    batch_size: int = 16  # samples per optimizer step
    validation_fraction: float = 0.02  # of the prompts, held out to choose the published epoch
    hard_label_weight: float = 0.0  # of the cross-entropy against the target's argmax (loss.py); 0: EAGLE-3's loss


    def check(self) -> None:
        """Refuse bad values by name, before anything is loaded or answered."""
        for name in ("num_samples", "max_len", "epochs", "ttt_steps", "batch_size", "head_intermediate_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.init and self.resume:
            raise ValueError("init starts a new run from a published head, resume continues --out's checkpoint: give one")
        if self.self_prompts < 0:
            raise ValueError(f"self_prompts must be >= 0, got {self.self_prompts}")
        if self.self_prompts and self.prompts is None:
            raise ValueError("self_prompts adds target-written prompts to a --prompts file; without one the target "
                             "writes --num-samples prompts itself")
        if not (self.lr > 0 and math.isfinite(self.lr)):  # inf trained a head of NaNs, and published it
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        # 0 meant the whole vocabulary; 1 trains nothing (a one-token distribution: the loss is 0 whatever the head)
        if self.draft_vocab_size is not None and self.draft_vocab_size < 2:
            raise ValueError(f"draft_vocab_size must be >= 2 (or unset: the target's whole vocabulary), got "
                             f"{self.draft_vocab_size}")
        if self.max_len < 16:
            raise ValueError(f"max_len must be >= 16, got {self.max_len}")
        if not 0 <= self.hard_label_weight <= 1:
            raise ValueError(f"hard_label_weight must be in [0, 1], got {self.hard_label_weight}")
        if not 0 <= self.validation_fraction < 0.5:
            raise ValueError(f"validation_fraction must be in [0, 0.5), got {self.validation_fraction}")
        self._check_paths()
        if not self.temperatures:
            raise ValueError("temperature: give at least one")
        for temperature in self.temperatures:  # inf was refused only by the first answer's SamplingParams
            if not (temperature >= 0 and math.isfinite(temperature)):
                raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        # Answers are sampled with seed + an offset (prompt index, temperature copy) that stays below 2**62, and a
        # request's seed must stay in int64: 2**63 was refused only once the first answer was asked for.
        if not -2**63 <= self.seed < 2**62:
            raise ValueError(f"seed must be an integer in [-2**63, 2**62), got {self.seed}")

    def check_against(self, target_vocab_size: int) -> None:
        """What needs the target's config, refused before anything is answered (a draft vocabulary too large failed
        after every prompt was)."""
        if (self.draft_vocab_size or 0) > target_vocab_size:
            raise ValueError(f"draft_vocab_size must be at most the target's vocab_size={target_vocab_size}, got "
                             f"{self.draft_vocab_size}")

    def _check_paths(self) -> None:
        """The paths given, by option name: a missing file, or a file where a directory belongs, surfaced as a bare
        '[Errno 17] File exists' (--out) or '[Errno 2] No such file' (--prompts) naming no option."""
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise ValueError(f"out {self.out!r} is a file: give a directory (created when missing)")
        # (a resumed run reads its samples from the checkpoint: its prompts file may be gone)
        if self.prompts is not None and not self.resume and not os.path.isfile(self.prompts):
            raise ValueError(f"prompts {self.prompts!r} is not a file: give a JSONL file of prompts, or leave it out "
                             "(the target writes its own)")
        if self.init is not None and not os.path.isdir(self.init):
            raise ValueError(f"init {self.init!r} is not a directory: give a head directory (a train-draft --out)")
