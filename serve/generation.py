"""A generative request at the gateway: from the parsed body to one generate task, and the handle awaiting it.

`prepare` turns a chat or completion body into the task's prompt and parameters: a specialist's
system prompt goes first when the request brings none, the chat template (the specialist's own, else
the base's) renders the conversation, the prompt's tokens are counted with the base's tokenizer,
and a prompt that does not fit the context is refused here, naming the limit. Parameters a request
leaves out take the specialist's defaults (what its bundle was scored with), then OpenAI's; an
omitted `max_tokens` means "as much as fits" (vLLM's rule), explicit ones must fit.

`Generation` is the gateway's side of one task: the pending slot (deadline timer, admission count),
the text stream when the client streams, and `close`, after which the gateway's receipts tell the
worker that nobody waits (it stops generating).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorafleet.core.wire import GenerateParams, Result
from lorafleet.models.causal import CausalLMError
from lorafleet.serve.completions import CHAT, GenerationBody
from lorafleet.serve.errors import ApiError, bad_request, worker_error
from lorafleet.serve.pending import TIMEOUT, PendingRequest
from lorafleet.serve.prompts import CausalPrompts
from lorafleet.serve.resolver import Route
from lorafleet.serve.textstream import TextStream

if TYPE_CHECKING:
    from lorafleet.serve.gateway import Gateway


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt: str
    prompt_tokens: int
    params: GenerateParams


def prepare(body: GenerationBody, route: Route, prompts: CausalPrompts) -> Prepared:
    """The task's prompt and parameters; 400 when the prompt (with `max_tokens`) exceeds the context."""
    spec = route.specialist
    defaults: dict[str, Any] = dict(spec.defaults or {}) if spec is not None else {}
    if body.kind == CHAT:
        assert body.messages is not None
        messages = body.messages
        if spec is not None and spec.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": spec.system_prompt}, *messages]
        try:
            prompt = prompts.render(messages, spec.chat_template if spec is not None else None)
        except CausalLMError as exc:
            raise bad_request("no_chat_template", f"model {route.model!r}: {exc}") from exc
        except Exception as exc:  # a template that raises on this conversation (e.g. roles out of order)
            raise bad_request("invalid_messages", f"model {route.model!r} cannot render these messages with its "
                              f"chat template: {exc}") from exc
        chat = True
    else:
        assert body.prompt is not None
        prompt, chat = body.prompt, False
    n = prompts.count(prompt, chat)
    context = prompts.context
    if n >= context:
        raise bad_request("context_length_exceeded", f"model {route.model!r} has a context of {context} tokens; "
                          f"this {'conversation' if chat else 'prompt'} has {n} tokens: shorten it")
    if body.max_tokens is not None:
        max_tokens = body.max_tokens
        if n + max_tokens > context:
            raise bad_request("context_length_exceeded",
                              f"model {route.model!r} has a context of {context} tokens; the prompt has {n} tokens "
                              f"and max_tokens is {max_tokens}: lower max_tokens to at most {context - n} or "
                              "shorten the prompt")
    else:
        default = defaults.get("max_tokens")
        max_tokens = min(int(default), context - n) if isinstance(default, int) and default > 0 else context - n
    temperature = body.temperature if body.temperature is not None else float(defaults.get("temperature", 1.0))
    top_p = body.top_p if body.top_p is not None else float(defaults.get("top_p", 1.0))
    params = GenerateParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=tuple(body.stop),
                            seed=body.seed, stream=body.stream, chat=chat)
    return Prepared(prompt, n, params)


class Generation:
    """One published generate task, awaited by a route (whole answer) or read as a stream (SSE)."""

    def __init__(self, gateway: Gateway, request_id: str, pending: PendingRequest, deadline_s: float,
                 stream: TextStream | None) -> None:
        self.gateway = gateway
        self.request_id = request_id
        self.pending = pending
        self.deadline_s = deadline_s
        self.stream = stream
        if stream is not None:
            pending.future.add_done_callback(self._ended)

    @property
    def future(self) -> Any:
        return self.pending.future

    async def result(self) -> Result:
        """The final result; ApiError for a worker's error or a passed deadline."""
        value = await self.pending.future
        return self._value(value)

    def _value(self, value: object) -> Result:
        if value is None:
            result = self.pending.results[0]
            assert result is not None
            return result
        if value is TIMEOUT:
            raise ApiError(504, "deadline_exceeded", f"the deadline of {self.deadline_s * 1000:.0f} ms passed before "
                           "the answer was complete; send a longer X-Lorafleet-Deadline-Ms, a smaller max_tokens, or "
                           "retry when the queue is shorter")
        assert isinstance(value, Result) and value.error_code is not None
        raise worker_error(value, self.request_id, self.gateway.cfg.retry_after_s)

    def _ended(self, future: Any) -> None:
        """The pending slot resolved: a deadline or a worker's error ends the stream too (a final already did)."""
        assert self.stream is not None
        if future.cancelled():
            return
        try:
            self._value(future.result())
        except ApiError as exc:
            self.stream.fail(exc.code, exc.message)

    def close(self) -> None:
        """Forget the request: from now on the gateway tells the worker that nobody waits for it."""
        self.gateway.pending.discard(self.request_id)
        self.gateway.streams.pop(self.request_id, None)
