"""Output tokens -> smg's ``chunk`` messages and the final ``complete`` (pure; no I/O).

:class:`OutputStream` applies what the engine does not: stop token ids and stop strings.

* A **stop token id** ends the request at that token; the token is sent (smg reports it
  as ``matched_stop``) and ``complete.matched_token_id`` names it.
* A **stop string** is matched on the output's bytes (each token's, from the served
  tokenizer's ``token_bytes``: a byte for the reference engine, the vocabulary's piece
  for a checkpoint; special tokens have none). While the output's tail could still become a stop string, those tokens are
  held back; once it cannot, they are sent. How much of each stop string the tail
  holds is followed byte by byte (Knuth-Morris-Pratt), so a token costs the same
  whatever the stop strings' length: they are checked on the worker's event loop,
  between every other request's tokens. When one matches, the request ends with
  ``complete.matched_stop_str``; the string's own tokens are sent only with
  ``no_stop_trim`` (smg's meaning: keep the stop string in the output).
* EOS (``finish_reason "eos"``) ends it with ``matched_token_id`` = the EOS id the engine
  sampled (a checkpoint may have several); ``length`` with
  ``finish_reason "length"``.

``completion_tokens`` counts the tokens sent; ``cached_tokens`` (every chunk and
``complete``) is the prompt tokens the prefill reused from its prefix cache, which the
caller sets from the first decode message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from pdgrpc.gateway.requests import GatewayRequest

if TYPE_CHECKING:
    from pdgrpc.engine.base import Tokenizer

__all__ = ["OutputStream"]


class OutputStream:
    def __init__(self, g: GatewayRequest, tokenizer: "Tokenizer") -> None:
        self.g = g
        self._tok = tokenizer
        self._last: int | None = None  # the last token generated
        self.sent: list[int] = []
        self.logprobs = pb.OutputLogProbs()
        self._bytes = bytearray()  # the output so far, as bytes (specials have none)
        self._held: list[tuple[int, float, Any]] = []  # (token, logprob, top) not sent yet
        self._fallback = [_fallback(s) for s in g.stop_strings]
        self._begun = [0] * len(g.stop_strings)  # per stop string: how much of it the output ends with
        self.cached_tokens = 0  # prompt tokens the prefill's prefix cache supplied

    def step(self, ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Any], finish_reason: str) -> list[Any]:
        """The messages for ``ids`` generated now (``finish_reason``: pdgrpc's, "" while
        running): a ``chunk`` when there is something to send, and ``complete`` last once
        the request is over (then it is the last message)."""
        g = self.g
        lps = list(logprobs) + [0.0] * (len(ids) - len(logprobs))
        tops = list(top) + [None] * (len(ids) - len(top))
        matched_id: int | None = None
        matched_str: bytes | None = None
        match_at = 0  # where matched_str starts in the output bytes
        for t, lp, tp in zip(ids, lps, tops):
            self._held.append((t, lp, tp))
            self._last = t
            piece = self._tok.token_bytes(t) if g.stop_strings else b""
            if piece:
                self._bytes += piece
                self._follow(piece)
                matched_str, match_at = self._find_stop(len(piece))
            if t in g.stop_token_ids:
                matched_id = t
            if matched_id is not None or matched_str is not None:
                break
        over = matched_id is not None or matched_str is not None or bool(finish_reason)
        if matched_str is not None and not g.no_stop_trim:
            del self._held[len(self._held) - self._tokens_for(len(self._bytes) - match_at):]  # the stop string's own tokens
        send = self._held if over else self._held[: len(self._held) - self._tokens_for(self._hold_back())]
        msgs = [self._chunk(send)] if send else []
        del self._held[: len(send)]
        if not over:
            return msgs
        done = pb.GenerateComplete(
            output_ids=self.sent, prompt_tokens=len(g.input_ids), completion_tokens=len(self.sent),
            cached_tokens=self.cached_tokens,
            finish_reason="length" if matched_id is None and matched_str is None and finish_reason == "length" else "stop",
        )
        if matched_id is not None:
            done.matched_token_id = matched_id
        elif matched_str is not None:
            done.matched_stop_str = matched_str.decode("utf-8", errors="replace")
        elif finish_reason == "eos" and self._last is not None:
            done.matched_token_id = self._last  # the engine stops right after an EOS id
        if g.return_logprob:
            done.output_logprobs.CopyFrom(self.logprobs)
        msgs.append(pb.GenerateResponse(request_id=g.request_id, complete=done))
        return msgs

    def _find_stop(self, new: int) -> tuple[bytes | None, int]:
        """The first stop string that ends within the last ``new`` output bytes, and where
        it starts (a token of several bytes may end past it)."""
        found: tuple[bytes | None, int] = (None, len(self._bytes))
        for s in self.g.stop_strings:
            start = max(0, len(self._bytes) - new - len(s) + 1)
            at = self._bytes.find(s, start)
            if at >= 0 and at + len(s) <= len(self._bytes) and at < found[1]:
                found = (s, at)
        return found

    def _follow(self, piece: bytes) -> None:
        """Advance, over the output's new bytes ``piece``, how much of each stop string the
        output ends with (a whole one falls back: its match is :meth:`_find_stop`'s)."""
        begun = self._begun
        for i, s in enumerate(self.g.stop_strings):
            fallback, k = self._fallback[i], begun[i]
            for b in piece:
                while k and s[k] != b:
                    k = fallback[k - 1]
                if s[k] == b:
                    k += 1
                if k == len(s):
                    k = fallback[k - 1]
            begun[i] = k

    def _hold_back(self) -> int:
        """How many trailing output bytes could still start a stop string."""
        return max(self._begun, default=0)

    def _tokens_for(self, nbytes: int) -> int:
        """How many trailing held tokens hold the last ``nbytes`` output bytes."""
        count = 0
        for t, _, _ in reversed(self._held):
            if nbytes <= 0:
                break
            count += 1
            nbytes -= len(self._tok.token_bytes(t))
        return count

    def _chunk(self, tokens: list[tuple[int, float, Any]]) -> Any:
        g = self.g
        ids = [t for t, _, _ in tokens]
        self.sent += ids
        chunk = pb.GenerateStreamChunk(
            token_ids=ids, prompt_tokens=len(g.input_ids), completion_tokens=len(self.sent), cached_tokens=self.cached_tokens
        )
        if g.return_logprob:
            step = pb.OutputLogProbs(
                token_logprobs=[lp for _, lp, _ in tokens], token_ids=ids,
                top_logprobs=[pb.TopLogProbs(values=tp.logprobs, token_ids=tp.token_ids) if tp is not None else pb.TopLogProbs() for _, _, tp in tokens],
            )
            self.logprobs.MergeFrom(step)
            chunk.output_logprobs.CopyFrom(step)
        return pb.GenerateResponse(request_id=g.request_id, chunk=chunk)


def _fallback(s: bytes) -> list[int]:
    """For each ``n``, the longest proper prefix of ``s[: n + 1]`` that also ends it (the
    Knuth-Morris-Pratt failure function): where a partial match of ``s`` resumes when the
    next byte does not continue it."""
    out = [0] * len(s)
    k = 0
    for n in range(1, len(s)):
        while k and s[n] != s[k]:
            k = out[k - 1]
        if s[n] == s[k]:
            k += 1
        out[n] = k
    return out
