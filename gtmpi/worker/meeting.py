"""A server's clients' collectives, met before they start.

A collective that some of its members were never sent waits for them for good: in gloo on the
worker's thread, in NCCL on its GPU's stream, and every other client's work on that worker
waits behind it. An ordinary session's dispatcher never sends such a thing; a server's client
sends what it likes (transport/wire.py checks each instruction, not that its partners got
theirs). So before a client's collective starts, each member tells the others which one it is
about to run (its kind, group and geometry) and waits until all of them have said the same; a
transfer's sender and receiver each tell the other, and the receiver waits for the sender's
word. Words go point to point over MPI, on a communicator of the workers' own, tagged with the
client's slot and carrying its admission's number: never taken for another client's, nor for
an earlier client's of the same slot.

A member waits for as long as its partners are busy: a partner may be running other clients'
work first (or waiting itself, in another client's collective). The one who decides is the
partner that was not sent it: a worker holding none of a client's work that hears a partner
wait for it (a word past its own count) for GRACE_S breaks that client (BROKEN: the server
drops the client and tells it why). The waiting member then leaves at the client's DROP, and
says so, so that no partner enters the collective short of a member. Different collectives met
are a break at once; so is a partner waiting for this worker at another collective of the same
client (a word of a collective past this worker's count of it: each member was sent its
collectives in another order, or in another group, and each waits for the other); a wait
longer than BACKSTOP_S (partners each waiting in the same client for something else that says
no word: crossed transfers) too.

A collective is met in two rounds. Having heard every partner's word, a member could not know
that each partner has heard its own: a partner still waiting could see its client dropped and
leave, and the member would wait in the collective for good (a server's data plane start hung
so in `dist.new_group`, one worker in it, the other gone). So each member then says a second
word, and enters only once every partner has said it too; a member that has said it leaves
no more on its own (only when a partner says it left in the first round), so a second word
heard is a partner that will enter.
"""
from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import Any, Callable, Iterable

from mpi4py import MPI

from ..transport.mpi import CLIENT_TIMEOUT_S, ClientGone, Sends
from ..transport.poll import wait_for

GRACE_S = CLIENT_TIMEOUT_S  # past a batch in flight from the server, as long as a client stalls
BACKSTOP_S = 10 * CLIENT_TIMEOUT_S
GONE = "gone"  # a member's word that it left the meeting


class Meeting:
    """One worker's words with the other workers about its server's clients' collectives."""

    def __init__(self, workers_comm: MPI.Intracomm, rank: int) -> None:
        self.comm = workers_comm.Dup()  # collective: every worker makes it at its first admit
        self.rank = rank  # this worker's rank in the job (the communicator's rank + 1)
        self.live: dict[int, int] = {}  # slot -> its client's admission number
        self.admitted = 0
        # what each partner said, in order: (slot, admission, channel, partner) -> (n, what)
        self.heard: dict[tuple, deque] = defaultdict(deque)
        self.counts: dict[tuple, int] = defaultdict(int)  # (slot, admission, channel) -> done
        self._sends = Sends()

    def admit(self, slot: int) -> None:
        """Every worker admits the server's clients in one order, so admissions number alike."""
        self.admitted += 1
        self.live[slot] = self.admitted

    def forget(self, slot: int) -> None:
        """A client gone: what was said of it goes, and what is still said is dropped as heard."""
        self._listen()
        gen = self.live.pop(slot, None)
        for table in (self.heard, self.counts):
            for key in [k for k in table if k[0] == slot and k[1] == gen]:
                del table[key]

    def say(self, slot: int, channel: tuple, to: Iterable[int], what: Any) -> int:
        """Tell the workers ``to`` that this one is at its next ``channel`` event of the client
        in ``slot`` (without waiting): that event's number."""
        gen = self.live[slot]
        key = (slot, gen, channel)
        n = self.counts[key] = self.counts[key] + 1
        for rank in to:
            self._sends.keep(self.comm.isend((gen, channel, n, what), rank - 1, slot))
            heard = self.heard.get((slot, gen, channel, rank))
            while heard and heard[0][0] < n:  # the partner's words of events past: old news
                heard.popleft()
        return n

    def meet(self, slot: int, channel: tuple, members: Iterable[int], what: Any,
             dropped: Callable[[], str | None]) -> None:
        """Say ``what`` to the other ``members``, then wait until each has said the same; then
        the second round (see above)."""
        others = [r for r in members if r != self.rank]
        if others:
            n = self.say(slot, channel, others, what)
            self.hear(slot, channel, others, n, what, dropped)
            go = (*channel, "go")
            self.hear(slot, go, others, self.say(slot, go, others, what), what, lambda: None,
                      left=(channel, n))

    def expect(self, slot: int, channel: tuple, partner: int, what: Any,
               dropped: Callable[[], str | None]) -> None:
        """Wait for ``partner``'s word of this worker's next ``channel`` event (a transfer's
        receiver, for its sender's), having said that it waits."""
        self.hear(slot, channel, [partner], self.say(slot, channel, (partner,), what), what,
                  dropped)

    def hear(self, slot: int, channel: tuple, partners: list[int], n: int, what: Any,
             dropped: Callable[[], str | None], left: tuple | None = None) -> None:
        """Wait until each of ``partners`` has said ``what`` as its ``n``th ``channel`` event;
        else leave (saying so) with ClientGone. ``left``: (channel, event) of a first round,
        where a partner's word that it left counts as leaving this one too."""
        gen = self.live[slot]
        deadline = time.monotonic() + BACKSTOP_S

        def settled() -> str | None:
            self._listen()
            missing = []
            for rank in partners:
                words = [w for w in self.heard[(slot, gen, channel, rank)] if w[0] == n]
                if left is not None:
                    words += [w for w in self.heard[(slot, gen, left[0], rank)]
                              if w[0] == left[1] and w[1] == GONE]
                if any(said == GONE for _, said in words):
                    return f"worker rank {rank} left {_named(what)} unmet"
                if not words:
                    missing.append(rank)
                elif words[0][1] != what:
                    return (f"its workers were sent different collectives: {_named(what)} here "
                            f"(worker rank {self.rank}), {_named(words[0][1])} on worker rank "
                            f"{rank}")
            if not missing:
                for rank in partners:
                    heard = self.heard[(slot, gen, channel, rank)]
                    while heard and heard[0][0] <= n:
                        heard.popleft()
                return ""
            for rank in missing:
                at = self._elsewhere(slot, gen, rank, channel)
                if at is not None:
                    return (f"its workers were sent crossed collectives: worker rank "
                            f"{self.rank} waits at {_named(what)} {_where(channel)}, worker "
                            f"rank {rank} at {_named(at[1])} {_where(at[0])}")
            why = dropped()
            if why is not None:
                return why
            if time.monotonic() > deadline:
                return (f"worker rank {self.rank} waited {BACKSTOP_S:.0f} s at {_named(what)} "
                        f"for worker rank(s) {', '.join(map(str, missing))}, each waiting in "
                        "another of its collectives or transfers")
            return None
        why = wait_for(settled)
        if why:
            for rank in partners:
                self._sends.keep(self.comm.isend((gen, channel, n, GONE), rank - 1, slot))
            raise ClientGone(why)

    def _elsewhere(self, slot: int, gen: int, rank: int, channel: tuple) -> tuple | None:
        """(channel, what) of another collective of the client's at which ``rank`` waits for
        this worker (its word there past this worker's count), or None. A transfer's words
        are not waits (a sender says its word and goes on); a second round's follow a first."""
        for (s, g, ch, r), words in self.heard.items():
            if s == slot and g == gen and r == rank and ch != channel and ch[0] == "c" and \
                    len(ch) == 2 and words and words[-1][1] != GONE and \
                    words[-1][0] > self.counts.get((s, g, ch), 0):
                return ch, words[-1][1]
        return None

    def waited_for(self) -> dict[int, str]:
        """The clients a partner waits for here, past this worker's own count of their events:
        slot -> what it waits at."""
        self._listen()
        found = {}
        for (slot, gen, channel, rank), words in self.heard.items():
            if words and words[-1][0] > self.counts.get((slot, gen, channel), 0) and \
                    words[-1][1] != GONE:
                found[slot] = f"worker rank {rank} waits at {_named(words[-1][1])}"
        return found

    def _listen(self) -> None:
        """Take every word that has come; those of clients gone are dropped."""
        status = MPI.Status()
        while (msg := self.comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)) is not None:
            gen, channel, n, what = msg.recv()
            slot = status.Get_tag()
            if self.live.get(slot) == gen:
                self.heard[(slot, gen, channel, status.Get_source() + 1)].append((n, what))


def _named(what: Any) -> str:
    kind, *rest = what
    return f"{kind}{tuple(rest)}" if rest else str(kind)


def _where(channel: tuple) -> str:
    if channel[0] == "t":
        return f"(worker rank {channel[1]} to {channel[2]})"
    return "(every worker)" if channel[1] is None else f"(group {channel[1]})"
