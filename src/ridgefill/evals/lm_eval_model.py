"""The `ridgefill` model for lm-evaluation-harness: any lm-eval task under exact, identity or ridge prefill.

lm-eval 0.4.x discovers no out-of-tree models (its registry is filled from its own model list), so importing
this module registers the model, and `ridgefill lm-eval ARGS...` (evals/lm_eval_cli.py) runs lm-eval's own CLI
after that import:

    ridgefill lm-eval --model ridgefill --model_args pretrained=M,maps=MAPS,tail=256 --tasks T
    ridgefill lm-eval --model ridgefill --model_args pretrained=M,fill=identity,split=18 --tasks T
    ridgefill lm-eval --model ridgefill --model_args pretrained=M --tasks T          # exact prefill

model_args: pretrained (a --model spec: alias, folder or Hub id), fill (exact | identity | ridge; default ridge
with maps, else exact), dtype (auto: bf16 on a GPU that supports it, else fp32), chunk (defaults.DEFAULT_CHUNK),
max_gen_toks (256), and the fill's options by their names (method/fill_fields.OPTIONS: maps, split, tail,
keep_first, outlier_factor, filled_window, filled_window_layers, with their defaults). Every request's context is
prefilled with the plan; the scored continuation and every generated token run the full model. Contexts that share
their tokens (a multiple-choice question's options) are prefilled once. loglikelihood_rolling is refused: filled
rows have no logits to score. lm-eval's --device picks the device (none given: auto, cuda when a GPU is visible);
the results' config records the resolved pair as model_device and model_dtype.
"""

from __future__ import annotations

import torch

from ridgefill.errors import RidgefillError
from ridgefill.evals.scoring import continuation_scores
from ridgefill.torchfill.prefill import DEFAULT_CHUNK
from ridgefill.method.fill import VARIANTS, FillSettings
from ridgefill.method.fill_fields import FIELD, OPTIONS
from ridgefill.runtime.console import note, progress_bar
from ridgefill.runtime.device import AUTO, resolve_device
from ridgefill.runtime.session import open_session

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
except ImportError:
    raise RidgefillError("lm-eval is not installed: pip install lm-eval==0.4.13 (ridgefill's `eval` extra)") from None

OWN_ARGS = ("fill", "chunk", "max_gen_toks")  # model_args of the model itself (the fill's: fill_fields.OPTIONS)
IGNORED_ARGS = ("pretrained", "dtype", "device", "batch_size", "max_batch_size")  # read by __init__ or by lm-eval


@register_model("ridgefill")
class RidgefillLM(TemplateLM):
    def __init__(self, pretrained: str = "smollm2-135m", dtype: str = AUTO, device: str | None = None,
                 batch_size=None, max_batch_size=None, **args) -> None:
        super().__init__()
        settings, fill, max_gen_toks, chunk = model_settings(**args)
        device, dtype = resolve_device(_device(device), str(dtype))
        self.resolved = {"model_device": device, "model_dtype": dtype}
        self.session = open_session(str(pretrained), dtype, device, chunk)
        self.plan, self.maps_meta = (None, None) if settings is None else settings.plan(self.session)
        self.fill = fill
        self.runner = self.session.runner
        self.tokenizer = self.session.tokenizer
        self.max_gen_toks = max_gen_toks
        self._device = torch.device(device)
        self._name = str(pretrained)

    # --- what lm-eval asks of a model ------------------------------------------------------------------
    def get_model_info(self) -> dict:
        """What lm-eval adds to its results' config: the device and dtype the model ran in (auto resolved)."""
        return dict(self.resolved)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.session.context_length or 2048

    @property
    def tokenizer_name(self) -> str:
        return self._name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The tokenizer's own special tokens (e.g. a BOS) unless the string already starts with them."""
        if add_special_tokens is None:
            bos = self.tokenizer.bos_token
            add_special_tokens = not (bos and string.startswith(bos))
        return self.tokenizer(string, add_special_tokens=add_special_tokens)["input_ids"]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Requests with the same context tokens share one prefill; each continuation is scored on a clone."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, context, _) in enumerate(requests):
            groups.setdefault(tuple(context), []).append(i)
        answers: list = [None] * len(requests)
        with progress_bar(f"loglikelihood ({self.fill})", len(requests)) as advance:
            for context, members in groups.items():
                continuations = [requests[i][2] for i in members]
                context = self._fit_context(list(context), max(len(c) for c in continuations))
                for i, score in zip(members, continuation_scores(self.runner, context, continuations, self.plan)):
                    answers[i] = score
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
                    advance()
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError(
            "the ridgefill model has no loglikelihood_rolling: filled prompt rows run no late layers and so have no "
            "logits to score; use a loglikelihood or generate_until task, or `ridgefill loss` for perplexity"
        )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        out = []
        with progress_bar(f"generate_until ({self.fill})", len(requests)) as advance:
            for request in requests:
                context, gen_kwargs = request.args
                kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
                if kwargs.get("do_sample"):
                    raise RidgefillError("the ridgefill model decodes greedily: run with --gen_kwargs do_sample=false")
                until = handle_stop_sequences(kwargs.get("until"), eos=eos)
                max_new = int(kwargs["max_gen_toks"])
                ids = self._fit_context(self.tok_encode(context), max_new)
                text = self._greedy_until(ids, until, max_new)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                out.append(text)
                advance()
        return out

    # --- helpers ------------------------------------------------------------------------------------------
    def _fit_context(self, context: list[int], reserve: int) -> list[int]:
        """Keep the last tokens of `context` so that `reserve` more tokens fit the model's context."""
        room = self.max_length - reserve
        if room < 1:
            raise RidgefillError(f"{reserve} continuation tokens leave no room for a context in the model's "
                                 f"{self.max_length}: shorten the continuation or lower max_gen_toks")
        return context[-room:]

    def _greedy_until(self, ids: list[int], until: list[str], max_new: int) -> str:
        """Greedy decoding after the filled prefill, stopping at the end-of-text token, at the first stop
        sequence (the text is cut before it) or after `max_new` tokens."""
        pre = self.runner.prefill(torch.tensor([ids]), fill=self.plan, capacity=len(ids) + max_new)
        eot = self.eot_token_id

        def stopped(tokens: list[int]) -> bool:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            return any(stop in text for stop in until)

        (tokens,) = self.runner.decode_greedy(pre.cache, pre.logits[:, -1].argmax(-1), max_new, eot,
                                              stopped if until else None)
        if eot is not None and tokens[-1] == eot:
            tokens = tokens[:-1]  # the end-of-text token is not text
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text


def _device(device: str | None) -> str:
    """lm-eval's --device (None, cpu, cuda, cuda:0, ...) as ridgefill's auto, cpu or cuda: None is auto; cuda falls
    back to the CPU when no GPU is visible, like lm-eval's hf model."""
    if device is None:
        return AUTO
    if str(device).startswith("cuda"):
        if torch.cuda.is_available():
            return "cuda"
        note(f"note: --device {device} but no CUDA GPU is visible: running on the CPU")
        return "cpu"
    return str(device)


def model_settings(fill=None, chunk=DEFAULT_CHUNK, max_gen_toks=256,
                   **args) -> tuple[FillSettings | None, str, int, int]:
    """The model_args checked, with no model loaded (`args`: the fill's, by their FillField names; the fill's
    defaults for those not given): (the fill's settings, None for exact; the fill's name; max_gen_toks; chunk)."""
    unknown = sorted(set(args) - set(OPTIONS))
    if unknown:
        raise RidgefillError(f"unknown model_args {unknown} for the ridgefill model: use "
                             f"{', '.join(IGNORED_ARGS[:3] + OWN_ARGS + OPTIONS)}")
    maps = args.get("maps")
    fill = fill or ("ridge" if maps else "exact")
    if fill not in VARIANTS:
        raise RidgefillError(f"unknown fill '{fill}': use {', '.join(VARIANTS)}")
    if maps and fill != "ridge":
        raise RidgefillError(f"maps were given with fill={fill}: drop maps, or use fill=ridge")
    max_gen_toks, chunk = _number("max_gen_toks", max_gen_toks, int), _number("chunk", chunk, int)
    if max_gen_toks < 1 or chunk < 1:
        raise RidgefillError(f"max_gen_toks and chunk must be at least 1, got {max_gen_toks} and {chunk}")
    settings = None
    if fill != "exact":
        settings = FillSettings(fill, **{k: _fill_arg(k, v) for k, v in args.items()})
    return settings, fill, max_gen_toks, chunk


def preflight(model_args: dict) -> None:
    """What `ridgefill lm-eval` checks before lm-eval starts: the model_args (model_settings), the model's identity
    (read without its weights) and that the maps were fitted for it."""
    from ridgefill.method.maps import check_for_model, read_maps_meta
    from ridgefill.runtime.models import model_identity

    settings, *_ = model_settings(**{k: v for k, v in model_args.items() if k not in IGNORED_ARGS})
    resolve_device(AUTO, str(model_args.get("dtype", AUTO)))  # a known dtype name
    identity = model_identity(str(model_args.get("pretrained", "smollm2-135m")))
    if settings is not None and settings.maps is not None:
        check_for_model(settings.maps, read_maps_meta(settings.maps), identity.info, settings.split)


def _fill_arg(name: str, value):
    """A fill model_arg as its FillField's type (None stays None: the option is off)."""
    kind = FIELD[name].kind
    return _number(name, value, kind) if value is not None and kind in (int, float) else value


def _number(name: str, value, kind):
    """A model_args value (lm-eval passes them as parsed from `key=value` text) as an int or a float; anything else
    is a one-line error."""
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise RidgefillError(f"model_args {name}={value!r} is not a{'n integer' if kind is int else ' number'}: "
                             f"give e.g. {name}={256 if kind is int else 20}") from None
