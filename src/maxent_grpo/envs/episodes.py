"""Multi-turn rollouts, token in and token out.

``run_episodes`` plays ``G`` episodes per dataset row. Each episode is one
token sequence after the prompt: every model turn appends the ids the sampler
drew (loss mask 1, with their behaviour log-probs), every environment answer
appends its messages rendered through the chat template once, as a suffix
(loss mask 0, log-prob 0). The next turn is sampled from exactly those ids
(``generate_ids``), so the trainer scores the tokens that were sampled: a
conversation re-tokenised from its text need not give the same ids.

The suffix of an observation is the template's text of the conversation with
the observation (and the next generation prompt) minus its text without it,
with the assistant turn's closing (what the template writes after the model's
end-of-turn token: ``"\\n"`` in ChatML) put in front. A template that rewrites
earlier turns when a message is added cannot be rendered this way and raises.

Limits: ``max_turns`` model turns; ``max_model_tokens`` sampled tokens over all
turns and ``max_episode_tokens`` model plus environment tokens (each turn's
``max_new_tokens`` is cut to what is left). An episode that reaches a limit ends
with ``finish_reason="length"``. An environment that raises or runs past
``step_timeout_s`` fails its episode; the episode's whole group is dropped and
counted, as an incomplete group is (pipeline ``incomplete_groups``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from maxent_grpo.core.bounds import require
from maxent_grpo.envs.protocol import Environment, EnvironmentFactory, Message, RowEnvironments, StepResult
from maxent_grpo.envs.tools import (
    CallTimeout,
    call_with_timeout,
    hermes_system_prompt,
    template_renders_tools,
    tool_schemas,
)
from maxent_grpo.envs.trl_compat import user_environment
from maxent_grpo.rollout.backend import Completion, PromptGroup, RolloutBatch, SamplingParams, build_rollout_batch


class TokenBackend(Protocol):
    def generate_ids(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams) -> list[PromptGroup]:
        ...


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_model_tokens: int
    max_episode_tokens: int
    step_timeout_s: float | None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_model_tokens", "max_episode_tokens"):
            value = getattr(self, name)
            require(not isinstance(value, bool) and isinstance(value, int) and value >= 1, name,
                    f"must be a positive integer, got {value!r}")
        require(self.max_episode_tokens >= self.max_model_tokens, "max_episode_tokens",
                f"must be >= the model's tokens over all turns ({self.max_model_tokens}), got {self.max_episode_tokens}")
        require(self.step_timeout_s is None or self.step_timeout_s > 0, "step_timeout_s",
                f"must be > 0 or null, got {self.step_timeout_s!r}")


@dataclass
class _Episode:
    row: int
    env: Environment
    messages: list[Message]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" once over
    failure: str | None = None
    turns: int = 0
    info: Counter = field(default_factory=Counter)
    reward: float | None = None

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)

    @property
    def over(self) -> bool:
        return self.finish is not None or self.failure is not None


@dataclass(frozen=True)
class EpisodePlay:
    """How a run plays episodes: each row's environment and the limits."""

    environments: RowEnvironments
    limits: EpisodeLimits


@dataclass(frozen=True)
class EpisodeBatch:
    rollout: RolloutBatch  # the rows whose G episodes all completed, prompt-major
    kept_rows: list[int]  # their indices in the rows given
    failures: list[str]  # one line per failed episode
    stats: dict[str, float]  # per-episode means (env/...) and time/environment
    # Each kept completion's environment, prompt-major: the user's own object for a TRL class.
    environments: list = field(default_factory=list)


def run_episodes(
    backend: TokenBackend,
    tokenizer,
    rows: Sequence[Mapping[str, Any]],
    factories: Sequence[EnvironmentFactory],
    num_generations: int,
    params: SamplingParams,
    limits: EpisodeLimits,
    frame: Callable[[list[Message]], list[Message]] | None = None,
) -> EpisodeBatch:
    """Play ``num_generations`` episodes of each row with its environment (``factories[i]`` for ``rows[i]``).

    ``frame`` puts the run's system prompt and few-shot turns around each opening (as one-shot prompts get them).
    """
    if len(factories) != len(rows) or not rows:
        raise ValueError(f"{len(rows)} rows need as many environment factories, got {len(factories)}")
    clock = _Clock()
    episodes, prompts, renders = [], [], []
    by_tools: dict[tuple[str, ...], _Render] = {}  # rows of one environment share its tools' rendering
    for i, (row, factory) in enumerate(zip(rows, factories)):
        group = [_open(i, factory, row, clock, limits.step_timeout_s) for _ in range(num_generations)]
        opened = [e for e in group if e.failure is None]
        if any(e.messages != opened[0].messages for e in opened[1:]):
            raise ValueError(f"row {i}: the environment's reset gave different messages for the same row")
        tools = opened[0].env.tools if opened else []
        key = tuple(t.__qualname__ for t in tools)
        render = by_tools.get(key) or by_tools.setdefault(key, _Render(tokenizer, tools))
        for e in opened:
            e.messages = render.opening(frame(e.messages) if frame is not None else e.messages)
        prompts.append(render.prompt_ids(opened[0].messages) if opened else [])
        renders.append(render)
        episodes += group

    for turn in range(limits.max_turns):
        live = [e for e in episodes if not e.over]
        if not live:
            break
        for budget, batch in _by_budget(live, params, limits).items():
            turn_params = dataclasses.replace(params.for_call(turn), max_new_tokens=budget)
            if turn == 0:  # every episode of a row still shares the prompt: one group per row
                rows_here = sorted({e.row for e in batch})
                groups = backend.generate_ids([prompts[r] for r in rows_here], num_generations, turn_params)
                comps = {r: list(g.completions) for r, g in zip(rows_here, groups)}
                drawn = [comps[e.row].pop(0) for e in batch]
            else:
                groups = backend.generate_ids([prompts[e.row] + e.tokens for e in batch], 1, turn_params)
                drawn = [g.completions[0] for g in groups]
            for e, comp in zip(batch, drawn):
                _take_turn(e, comp, renders[e.row], tokenizer, clock, limits, last=turn + 1 == limits.max_turns)
    for e in episodes:
        if not e.over:  # max_turns ran out with the environment still answering
            e.finish = "length"
        if e.failure is None:
            _score(e, clock, limits.step_timeout_s)
    return _collect(episodes, rows, prompts, num_generations, tokenizer, clock)


class _Clock:
    """Calls into the environments: timed, bounded by a timeout, a failure caught as the episode's."""

    def __init__(self) -> None:
        self.seconds = 0.0  # spent inside the environments

    def call(self, row: int, what: str, fn, timeout_s) -> tuple[Any, str | None]:
        """``(fn(), None)``, or ``(None, one line)`` when it raised or ran past ``timeout_s``."""
        t0 = time.perf_counter()
        try:
            return call_with_timeout(fn, timeout_s), None
        except CallTimeout as exc:
            return None, f"row {row}: {what}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a failed episode is counted and bounded, not a crash
            return None, f"row {row}: {what} raised {type(exc).__name__}: {exc}"
        finally:
            self.seconds += time.perf_counter() - t0


def _open(row_idx: int, factory: EnvironmentFactory, row, clock: _Clock, timeout_s) -> _Episode:
    env = factory()
    messages, failure = clock.call(row_idx, "reset", lambda: env.reset(row), timeout_s)
    if failure is not None:
        return _Episode(row_idx, env, [], failure=failure)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"row {row_idx}: reset must return a non-empty list of messages, got {messages!r}")
    return _Episode(row_idx, env, [dict(m) for m in messages])


def _by_budget(live: list[_Episode], params: SamplingParams, limits: EpisodeLimits) -> dict[int, list[_Episode]]:
    out: dict[int, list[_Episode]] = {}
    for e in live:
        budget = min(params.max_new_tokens, limits.max_model_tokens - e.model_tokens,
                     limits.max_episode_tokens - len(e.tokens))
        out.setdefault(budget, []).append(e)
    return out


def _take_turn(e: _Episode, comp: Completion, render: "_Render", tokenizer, clock: _Clock, limits: EpisodeLimits,
               *, last: bool) -> None:
    e.tokens += comp.token_ids
    e.mask += [1] * len(comp.token_ids)
    e.logps += list(comp.logps) if comp.logps is not None else [0.0] * len(comp.token_ids)
    e.turns += 1
    if comp.finish_reason == "length":
        e.finish = "length"
        return
    assistant = {"role": "assistant", "content": comp.text}
    result, e.failure = clock.call(e.row, "step", lambda: e.env.step(list(e.messages), assistant),
                                   limits.step_timeout_s)
    if e.failure is not None:
        return
    if not isinstance(result, StepResult):
        raise TypeError(f"row {e.row}: step must return a StepResult, got {type(result).__name__}")
    e.info.update(result.info)
    if result.done:
        e.finish = "stop"
        return
    if last:
        e.finish = "length"
        return
    suffix = render.suffix(e.messages, assistant, result.observation, ended_on_eos=_ends_turn(comp, tokenizer))
    if len(e.tokens) + len(suffix) >= limits.max_episode_tokens:
        e.finish = "length"
        return
    e.messages += [assistant, *result.observation]
    e.tokens += suffix
    e.mask += [0] * len(suffix)
    e.logps += [0.0] * len(suffix)


def _score(e: _Episode, clock: _Clock, timeout_s) -> None:
    reward, e.failure = clock.call(e.row, "get_reward", e.env.get_reward, timeout_s)
    if e.failure is not None:
        return
    if reward is not None and not isinstance(reward, (int, float)):
        raise TypeError(f"row {e.row}: get_reward must return a number or None, got {type(reward).__name__}")
    e.reward = None if reward is None else float(reward)


def _ends_turn(comp: Completion, tokenizer) -> bool:
    return bool(comp.token_ids) and comp.token_ids[-1] == tokenizer.eos_token_id


class _Render:
    """How a row's environment's conversation becomes tokens through the chat template."""

    def __init__(self, tokenizer, tools: Sequence):
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.native = bool(self.tools) and template_renders_tools(tokenizer, self.tools)
        self.kwargs = {"tools": tool_schemas(self.tools)} if self.native else {}
        # Where the template has no tools: the Hermes description, as a system message.
        self.described = hermes_system_prompt(self.tools) if self.tools and not self.native else None

    def opening(self, messages: list[Message]) -> list[Message]:
        """The opening messages, with the Hermes tool description where the template has no tools."""
        described = self.described
        if described is None:
            return messages
        if messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + described}, *messages[1:]]
        return [{"role": "system", "content": described}, *messages]

    def _text(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.kwargs)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self.tokenizer(self._text(messages, True), add_special_tokens=False)["input_ids"]

    def suffix(self, messages: list[Message], assistant: Message, observation: list[Message], *,
               ended_on_eos: bool) -> list[int]:
        before = self._text([*messages, assistant], False)
        after = self._text([*messages, assistant, *observation], True)
        if not after.startswith(before):
            raise ValueError("the chat template rewrites earlier turns when a message is added; "
                             "its episodes cannot be extended token by token")
        eos = self.tokenizer.eos_token
        cut = before.rfind(eos)
        if cut < 0:
            raise ValueError(f"the chat template does not close an assistant turn with the eos token {eos!r}")
        closing = before[cut + len(eos):]
        text = (closing if ended_on_eos else eos + closing) + after[len(before):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _collect(episodes, rows, prompts, g, tokenizer, clock: _Clock) -> EpisodeBatch:
    groups, kept, failures = [], [], [e.failure for e in episodes if e.failure is not None]
    for i in range(len(rows)):
        group = episodes[i * g:(i + 1) * g]
        if any(e.failure is not None for e in group):
            continue
        kept.append(i)
        groups.append(PromptGroup(
            prompt=tokenizer.decode(prompts[i], skip_special_tokens=False),
            prompt_ids=prompts[i],
            completions=[Completion(
                token_ids=e.tokens,
                text=tokenizer.decode(e.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False),
                finish_reason=e.finish, logps=e.logps, loss_mask=e.mask, env_reward=e.reward,
            ) for e in group],
        ))
    done = [e for e in episodes if e.failure is None]
    n = max(len(done), 1)
    keys = sorted({k for e in done for k in e.info})
    stats = {
        "env/turns": sum(e.turns for e in done) / n,
        "env/model_tokens": sum(e.model_tokens for e in done) / n,
        "env/env_tokens": sum(len(e.tokens) - e.model_tokens for e in done) / n,
        "env/failed_episodes": float(len(failures)),
        "time/environment": clock.seconds,
        **{f"env/{k}": sum(e.info[k] for e in done) / n for k in keys},
    }
    environments = [user_environment(e.env) for i in kept for e in episodes[i * g:(i + 1) * g]]
    return EpisodeBatch(rollout=build_rollout_batch(groups, g), kept_rows=kept, failures=failures, stats=stats,
                        environments=environments)
