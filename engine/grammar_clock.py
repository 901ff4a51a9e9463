"""What a sequence's grammar costs the batch, and its bound.

llguidance walks a grammar's parse at every output token (the mask in the worker thread, the token's advance on
the event loop), and every other request's step waits for it. Ordinary constraints cost well under 1 ms a token
(measured, SmolLM2's 49,152 tokens: a JSON schema 0.7, a 2,000-entry enum 0.45, a regex 0.55, 1,024 choices
0.02 ms); an ambiguous grammar's rows grow with its output (a 40-byte one: 24 ms a token on average, 4 s over 165
tokens before llguidance's row limit ended it). A sequence whose grammar has cost more than FLOOR_SECONDS in all and
more than MAX_MS_PER_TOKEN a token lately fails alone, as a grammar past llguidance's limits does.

The worker thread adds a step's mask time (`add_mask`); the event-loop thread reads it after the step, when it
advances the matcher (`on_token`): never both at once. Both measure the thread's CPU time, not the wall's: on a
machine whose cores other processes take, an ordinary grammar's wall time per token can grow many times over.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOOR_SECONDS = 0.25  # below this in all, no sequence fails: a costly first mask alone never ends one
MAX_MS_PER_TOKEN = 5.0  # 10x the costliest ordinary constraint measured
RECENT_WEIGHT = 0.125  # of each new token in the moving average: about the last 8 tokens


@dataclass(slots=True)
class GrammarClock:
    seconds: float = 0.0  # mask and advance, over every token so far
    recent_ms: float = 0.0  # per token, moving average
    num_tokens: int = 0
    unread_mask_seconds: float = 0.0  # this step's masks, not yet counted to a token

    def add_mask(self, seconds: float) -> None:
        self.unread_mask_seconds += seconds

    def on_token(self, advance_seconds: float) -> str | None:
        """Count one output token's grammar time; a message once the sequence is over its bound, else None."""
        spent = self.unread_mask_seconds + advance_seconds
        self.unread_mask_seconds = 0.0
        self.seconds += spent
        self.num_tokens += 1
        self.recent_ms += RECENT_WEIGHT * (spent * 1000 - self.recent_ms)
        if self.seconds <= FLOOR_SECONDS or self.recent_ms <= MAX_MS_PER_TOKEN:
            return None
        return (f"evaluating the grammar took {self.seconds:.2f} s over {self.num_tokens} tokens, "
                f"{self.recent_ms:.0f} ms a token lately (at most {MAX_MS_PER_TOKEN:g} ms): every request's step waits "
                "for it; an unambiguous grammar (e.g. left-recursive rules) is evaluated in far less")  # fmt: skip
