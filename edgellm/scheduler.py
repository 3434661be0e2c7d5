"""Many sequences on one model: the engine thread and its scheduler (continuous batching).

Requests arrive from any thread (`Engine.submit`) and wait in a queue. One engine thread runs steps:
each step takes one decode token from every running sequence, fills the rest of the token budget
(`n_batch`) with prompt chunks — of sequences admitted earlier, then of waiting requests while fewer
than `n_seq` run — and runs them as one ragged batch (`Runtime.forward`). A sequence that finishes
frees its slot at once, and a waiting request takes it in the next step ("continuous"; the "static"
policy admits a new batch only when the whole previous one has finished, for comparison).

A new request first takes the longest cached prefix of its prompt from the KV cache (its own
earlier turns, or a shared system prompt) and evaluates only the rest. When the pool has no block
for a running sequence's next token, the newest sequence is preempted: its blocks go back (the full
ones stay cached, so its recomputation is mostly a prefix hit) and it waits at the head of the
queue with its prompt and the tokens generated so far as its new prompt.

Speculative decoding (`spec`, edgellm/speculative.py; prompt lookup, llama.cpp's `ngram-simple`):
while one sequence runs alone, its step may also verify tokens proposed by looking its last n-gram
up in its own tokens. They go in as consecutive single-token entries (each in the one-token order,
so every verified position gets plain decoding's logits), the sampler walks them (`verify`), only
the kept tokens are committed to the cache and the rest of the step's blocks go back. With more
than one sequence running (or waiting) the engine stands down and proposes nothing.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque

import numpy as np

from edgellm.errors import ContextFullError, InvalidArgumentError, KVCacheFullError
from edgellm.generate import _END, Request, SeqStream, Stats, logprobs_of, now
from edgellm.speculative import DraftLength, DraftModel, PromptLookup, SpecParams, verify

POLICIES = ("continuous", "static")
IDLE_S = 2.0  # the engine thread ends after this long without work
PROBE_EVERY = 16  # a sequence whose draft length is 0 still verifies a proposal once in this many steps,
PROBE_MAX = 256  # ... twice as many after each probe that did not bring speculation back, up to this
HANDOFF_S = 0.05  # the engine thread leaves the steps to a caller that ran one this recently


class SeqState:
    """A request inside the engine: its tokens, sampler, stream and KV blocks."""

    _ids = itertools.count()

    def __init__(self, ids: list[int], sampler, stream: SeqStream, logprobs: int | None, stats: Stats):
        self.id = next(self._ids)
        self.prompt = list(ids)  # what must be in the cache before sampling: the prompt, and after a
        self.sampler = sampler  # preemption the tokens generated so far too
        self.history = list(ids)  # for the repetition penalty
        self.stream = stream
        self.logprobs = logprobs
        self.stats = stats
        self.kv = None  # SeqKV while admitted
        self.n_done = 0  # tokens of `prompt` in the cache
        self.next_token: int | None = None  # sampled, to be evaluated next step
        self.cancelled = False
        self.cache_prompt = True  # take the prompt's cached prefix from the KV cache
        self.finished = False
        self.request: Request | None = None
        self.t_submit = now()
        self.t_admit = 0.0
        self.t_first = 0.0
        self.decode_steps = 0
        self.device_s: dict[str, float] = {}
        self.crossings = 0  # activation copies between devices in the latest decode step
        self.lookup: PromptLookup | None = None  # speculative decoding: the sequence's n-grams
        self.dkv = None  # ... or its sequence in the draft model's cache
        self.draft: DraftLength | None = None  # ... and how many tokens to propose
        self.proposal: list[int] = []  # tokens proposed for the step being run
        self.idle_steps = 0  # steps in a row with a proposal found but none chosen
        self.probe_every = PROBE_EVERY

    @property
    def prefilling(self) -> bool:
        return self.n_done < len(self.prompt)


class Engine:
    def __init__(self, runtime, tokenizer, *, n_seq: int, n_batch: int, n_ctx: int, policy: str = "continuous",
                 lock: threading.RLock | None = None, spec: SpecParams | None = None, batch_invariant: bool = False,
                 draft: DraftModel | None = None):
        if policy not in POLICIES:
            raise InvalidArgumentError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if spec is not None and (spec.spec_type == "draft-simple") != (draft is not None):
            raise InvalidArgumentError("spec type 'draft-simple' needs a draft model (--model-draft), and a draft "
                                       "model needs spec type 'draft-simple'")
        self.spec = spec if spec is not None and spec.spec_type != "none" else None
        self.draft_model = draft if self.spec is not None else None
        # rows a verification step may hold: the whole step must stay in the one-token order
        self.spec_rows = runtime.exact_decode_rows() if self.spec is not None else 1
        self._step_s: dict = {}  # tokens in a lone sequence's step -> EWMA seconds (DraftLength.step_s)
        self._exact_rows: int | None = None  # runtime.exact_decode_rows(), once (_forward)
        # every sequence gets the tokens it gets alone, whatever else runs (slower: more passes)
        self.batch_invariant = bool(batch_invariant)
        self._step_sizes: set = set()  # sizes run once: a size's first step (scratch buffers) is not timed
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.n_seq = n_seq
        self.n_batch = n_batch
        self.n_ctx = n_ctx
        self.policy = policy
        self.lock = lock or threading.RLock()  # held while a step runs (the runtime is not reentrant)
        self._free = threading.Event()  # clear while held(): the engine thread starts no step
        self._free.set()
        self._cv = threading.Condition()  # guards the queues below
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._driven_at = 0.0  # when a caller last ran a step (Engine.drive)
        self.dedicated: threading.Thread | None = None  # the thread in run_forever, if one is
        self.counters = dict(requests=0, finished=0, cancelled=0, preemptions=0, prompt_tokens=0,
                             cached_tokens=0, gen_tokens=0, steps=0)

    # --- the callers' side -------------------------------------------------------------------------
    def submit(self, ids: list[int], sampler, stream: SeqStream, logprobs: int | None = None,
               cache_prompt: bool = True) -> Request:
        if len(ids) >= self.n_ctx:
            raise ContextFullError(f"the prompt is {len(ids)} tokens but the context holds {self.n_ctx}; "
                                   "shorten the prompt or load with a larger n_ctx (-c)")
        cache = self.runtime.cache
        for g in cache.groups:
            need = -(-min(len(ids) + 1, self.n_ctx) // cache.block_size)
            if g.window == 0 and need > g.pool.n_blocks:
                raise KVCacheFullError(f"the prompt needs {need} KV blocks but the cache has {g.pool.n_blocks}; "
                                       "load with a larger kv_size")
        if self._closed:
            raise InvalidArgumentError("the model is closed")
        state = SeqState(ids, sampler, stream, logprobs, Stats(prompt_tokens=len(ids), n_ctx=self.n_ctx))
        state.cache_prompt = cache_prompt
        if self.spec is not None and self.spec_rows > 1:
            dm = self.draft_model
            if dm is None:
                state.lookup = PromptLookup(self.spec.ngram_n, self.spec.ngram_m)
                state.lookup.extend(ids)
            state.draft = DraftLength(self.spec.n_max, self.spec.n_min, step_s=self._step_s,
                                      draft_s=dm.step_s if dm else {}, drafting=dm is not None,
                                      draft_prior=dm.size_ratio if dm else 0.0)
        req = state.request = Request(self, state)
        with self._cv:
            self.waiting.append(state)
            self.counters["requests"] += 1
            self._driven_at = max(self._driven_at, now())  # the caller iterating it gets to drive first
            if self._thread is None and self.dedicated is None:
                self._thread = threading.Thread(target=self._loop, name="edgellm-engine", daemon=True)
                self._thread.start()
            self._cv.notify()
        return req

    def cancel(self, state: SeqState) -> None:
        with self._cv:
            state.cancelled = True
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            thread = self._thread
            self._cv.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    def stats(self) -> dict:
        counts = self.runtime.cache.block_counts()
        with self._cv:
            return dict(running=len(self.running), waiting=len(self.waiting), n_seq=self.n_seq, policy=self.policy,
                        kv_blocks_total=counts["total"], kv_blocks_used=counts["used"],
                        kv_blocks_cached=counts["cached"], kv_blocks_free=counts["free"],
                        kv_block_size=self.runtime.cache.block_size, preemptions=self.counters["preemptions"],
                        requests_total=self.counters["requests"], requests_finished=self.counters["finished"],
                        requests_cancelled=self.counters["cancelled"],
                        prompt_tokens_total=self.counters["prompt_tokens"],
                        cached_tokens_total=self.counters["cached_tokens"],
                        gen_tokens_total=self.counters["gen_tokens"], steps=self.counters["steps"])

    # --- the engine thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        """Steps while there is work and no caller drives the engine; the thread ends after IDLE_S
        without any (so an unused model holds no thread, and a dropped one can be freed), and
        submit starts a new one."""
        while True:
            with self._cv:
                if not (self.waiting or self.running or self._closed):
                    self._cv.wait(IDLE_S)
                if not (self.waiting or self.running):
                    self._thread = None
                    return
            if not self._run_step(blocking=True, unless_driven=True):
                time.sleep(HANDOFF_S)  # a caller iterating a Request runs the steps

    def run_forever(self) -> None:
        """Schedule every step from the calling thread until close() (a server: one thread steps for
        all requests, which only wait)."""
        self.dedicated = threading.current_thread()
        while True:
            with self._cv:
                while not (self.waiting or self.running or self._closed):
                    self._cv.wait()
                if self._closed and not (self.waiting or self.running):
                    return
            self._free.wait()
            self._run_step(blocking=True)

    @contextlib.contextmanager
    def held(self):
        """No step runs inside: the engine thread finishes the step it is in and starts no other
        until the block ends (a bare `with lock` can wait many steps: the stepping thread takes the
        lock again first)."""
        self._free.clear()
        try:
            with self.lock:
                yield
        finally:
            self._free.set()

    def drive(self, waiting_for=None) -> bool:
        """Run one step from the calling thread (a caller waiting for its Request's next chunk; it
        waits for a step another thread is running first); its kernels run on the kernel thread
        (Backend.run) whichever thread schedules it. A caller that schedules the step it waits for
        saves a thread hand-over per token, so the engine thread steps only when nobody iterates.
        True if a step ran or `waiting_for` (a Request) has a chunk now."""
        self._driven_at = now()
        ran = self._run_step(blocking=True, unless_ready=waiting_for)
        self._driven_at = now()
        return ran

    def _run_step(self, blocking: bool, unless_driven: bool = False, unless_ready=None) -> bool:
        if unless_driven and now() - self._driven_at < HANDOFF_S:
            return False
        if not self.lock.acquire(blocking=blocking):
            return False
        try:
            if unless_driven and now() - self._driven_at < HANDOFF_S:
                return False
            if unless_ready is not None and unless_ready._ready():
                return True
            with self._cv:
                if not (self.waiting or self.running):
                    return False
            self.step()
            return True
        except BaseException as e:  # a failed step fails its sequences, not the engine
            self._fail_all(e)
            return True
        finally:
            self.lock.release()

    def _fail_all(self, e: BaseException) -> None:
        with self._cv:
            victims = self.running + list(self.waiting)
            self.running, self.waiting = [], deque()
        for s in victims:
            self._release(s)
            s.request._put(e)

    def _release(self, s: SeqState) -> None:
        if s.kv is not None:
            s.kv.free()
            s.kv = None
        if s.dkv is not None:
            self.draft_model.release(s.dkv)
            s.dkv = None

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [s for s in self.running if s.cancelled] + [s for s in self.waiting if s.cancelled]
            self.running = [s for s in self.running if not s.cancelled]
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
            if self._closed:
                gone += self.running + list(self.waiting)
                self.running, self.waiting = [], deque()
        for s in gone:
            self._release(s)
            s.stats.finish_reason = s.stats.finish_reason or "cancelled"
            self.counters["cancelled"] += 1
            s.request._put(_END)

    def _preempt(self) -> bool:
        """Free the newest running sequence's blocks and send it back to the head of the queue."""
        with self._cv:
            if not self.running:
                return False
            victim = max(self.running, key=lambda s: s.t_admit)
            self.running.remove(victim)
            self._release(victim)
            if victim.next_token is not None:  # sampled and emitted, not yet evaluated: recompute it too
                victim.prompt = victim.prompt[:victim.n_done] + [victim.next_token]
                victim.next_token = None
            victim.n_done = 0
            victim.proposal = []
            victim.stats.preemptions += 1
            self.counters["preemptions"] += 1
            self.waiting.appendleft(victim)
        return True

    def _admit(self, s: SeqState) -> bool:
        """Give s a sequence in the cache with its cached prefix; False if the pool cannot hold
        its first chunk now."""
        cache = self.runtime.cache
        s.kv = cache.new_sequence()
        cached = s.kv.reuse_prefix(s.prompt) if s.cache_prompt or s.stats.preemptions else 0
        s.n_done = cached
        if not s.kv.can_grow(min(len(s.prompt) - cached, self.n_batch)):
            self._release(s)
            return False
        if s.t_admit == 0.0:
            s.stats.cached_tokens = cached
            s.stats.queue_ms = 1000 * (now() - s.t_submit)
            self.counters["cached_tokens"] += cached
        s.t_admit = now()
        return True

    def _schedule(self):
        """(entries, rows, sequences per entry) for the next step: decode tokens first, then
        prompt chunks, within n_batch tokens."""
        budget = self.n_batch
        singles, chunks = [], []  # (state, token ids)
        # 1. one token for every decoding sequence (oldest first; preempt the newest if short), and
        # a lone sequence's proposed tokens
        for s in sorted(self.running, key=lambda s: s.t_admit):
            if s.prefilling or s not in self.running:
                continue
            proposal = self._proposal(s)
            if proposal and s.kv.grow(1 + len(proposal)):
                s.proposal = proposal
                singles.append((s, [s.next_token] + proposal))
                budget -= 1 + len(proposal)
                continue
            while s in self.running and not s.kv.grow(1):
                self._preempt()
            if s in self.running:
                singles.append((s, [s.next_token]))
                budget -= 1
        # 2. prompt chunks of admitted sequences, then new admissions. With batch_invariant each
        # chunk is the one the prompt gets alone (its next n_batch tokens, the budget counting prompt
        # tokens only), so that it runs as it would alone (_forward); a chunk that does not fit the
        # budget left then waits for the next step, unless it would be the step's first
        alone = self.batch_invariant
        if alone:
            budget = self.n_batch

        def chunk(s):
            return min(len(s.prompt) - s.n_done, self.n_batch if alone else budget)

        for s in sorted(self.running, key=lambda s: s.t_admit):
            if not s.prefilling:
                continue
            n = chunk(s)
            if (chunks and n > budget) if alone else budget <= 0:
                break
            if s.kv.grow(n):
                (singles if n == 1 else chunks).append((s, s.prompt[s.n_done:s.n_done + n]))
                budget -= n
        admit_ok = self.policy == "continuous" or not self.running
        while budget > 0 and admit_ok:
            with self._cv:
                if not self.waiting or len(self.running) >= self.n_seq:
                    break
                s = self.waiting[0]
            if alone and chunks and min(len(s.prompt) - s.n_done, self.n_batch) > budget:  # (before its cached prefix)
                break
            if not self._admit(s):
                break
            with self._cv:
                self.waiting.popleft()
                self.running.append(s)
            n = chunk(s)
            s.kv.grow(n)
            (singles if n == 1 else chunks).append((s, s.prompt[s.n_done:s.n_done + n]))
            budget -= n
        return singles + chunks

    def _proposal(self, s: SeqState) -> list[int]:
        """Tokens to verify after s's next token this step: prompt lookup's or the draft model's, as
        many as DraftLength chooses; none unless s runs alone (nothing else running or waiting)."""
        if s.draft is None:
            return []
        with self._cv:
            if len(self.running) != 1 or self.waiting:
                return []
        room = min(self.spec_rows, self.n_batch, self.n_ctx - s.kv.n_past, s.stream.max_tokens - s.stream.n) - 1
        room = min(room, self.spec.n_max)
        if room <= 0:
            return []
        available = len(s.lookup.propose(room)) if s.lookup is not None else room
        k = s.draft.choose(available)
        if available and not k:  # stood down: now and then verify anyway, so acceptance and cost stay current
            s.idle_steps += 1
            if (s.idle_steps >= s.probe_every and available >= max(self.spec.n_min, 1)
                    and s.draft.could_pay(available)):
                s.idle_steps, k = 0, s.draft.probe_length(available)
                s.probe_every = min(2 * s.probe_every, PROBE_MAX)
        elif k:
            s.probe_every = PROBE_EVERY
        if not k:
            return []
        if s.lookup is not None:
            return s.lookup.propose(k)
        if s.dkv is None:
            s.dkv = self.draft_model.new_sequence()
        found = self.draft_model.propose(s.dkv, s.prompt[:s.n_done] + [s.next_token], k)
        return found if len(found) >= self.spec.n_min else []

    def step(self) -> None:
        self._drop_cancelled()
        work = self._schedule()
        if not work:
            return
        entries, rows, samplers, hold = [], [], [], []  # samplers: (state, its first row, rows)
        t = 0
        for s, toks in work:
            decoding = not s.prefilling
            if decoding and s.proposal:  # one single-token entry per position: the one-token order
                entries += [(s.kv, np.asarray([tok], np.int64)) for tok in toks]
                hold.append(s.kv)
                samplers.append((s, len(rows), len(toks)))
                rows += range(t, t + len(toks))
                t += len(toks)
                continue
            entries.append((s.kv, np.asarray(toks, np.int64)))
            t += len(toks)
            if decoding or s.n_done + len(toks) == len(s.prompt):
                samplers.append((s, len(rows), 1))
                rows.append(t - 1)
        timing = self.runtime.timing
        before, crossed = dict(timing.seconds), timing.crossings
        t0 = now()
        logits = self._forward(entries, rows, hold)
        wall = now() - t0
        step_s = {d: timing.seconds.get(d, 0.0) - before.get(d, 0.0) for d in timing.seconds}
        self.counters["steps"] += 1
        for s, toks in work:
            if s.prefilling:
                s.n_done += len(toks)
                self.counters["prompt_tokens"] += len(toks)
            else:
                s.decode_steps += 1
                s.crossings = timing.crossings - crossed
                for d, sec in step_s.items():
                    s.device_s[d] = s.device_s.get(d, 0.0) + sec
                if s.draft is not None and len(work) == 1:
                    if len(toks) in self._step_sizes:  # a lone sequence's step: its cost by size
                        s.draft.record_step(len(toks), wall)
                    self._step_sizes.add(len(toks))
                if s.proposal:
                    continue  # committed by _verify
                s.n_done += 1
                s.prompt.append(s.next_token)
                s.next_token = None
        for s, r0, n in samplers:
            if n > 1:
                self._verify(s, logits[r0:r0 + n])
            else:
                self._sample(s, logits[r0])

    def _forward(self, entries, rows, hold) -> np.ndarray:
        """The step's forward pass; with batch_invariant, separate passes: the one-token entries by
        as many as keep the one-token order (each token gets the bits it gets decoded alone), then
        each prompt chunk on its own (the bits it gets alone), so that a sequence's tokens do not
        depend on which others share its steps."""
        if not self.batch_invariant:
            return self.runtime.forward(entries, rows=rows, hold=hold)
        if self._exact_rows is None:
            self._exact_rows = self.runtime.exact_decode_rows()
        # one-token rows per pass: as many as keep the one-token order (K-quant products tile from 8
        # rows on); where every batch takes another order (float weights, a GPU layer), all together
        per = self._exact_rows if self._exact_rows > 1 else len(entries)
        groups, cur = [], []
        for e in entries:
            if len(e[1]) > 1 or len(cur) == per:
                if cur:
                    groups.append(cur)
                cur = []
            if len(e[1]) > 1:
                groups.append([e])
            else:
                cur.append(e)
        if cur:
            groups.append(cur)
        if len(groups) == 1:
            return self.runtime.forward(entries, rows=rows, hold=hold)
        out, t0 = [], 0
        for g in groups:
            t1 = t0 + sum(len(e[1]) for e in g)
            local = [r - t0 for r in rows if t0 <= r < t1]
            seqs = {id(e[0]) for e in g}
            logits = self.runtime.forward(g, rows=local, hold=[h for h in hold if id(h) in seqs])
            if local:
                out.append(logits)
            t0 = t1
        return np.concatenate(out) if out else np.empty((0, self.runtime.cfg.n_vocab), np.float32)

    def _verify(self, s: SeqState, logits: np.ndarray) -> None:
        """s's verification step: the sampler's draws over the rows (`verify`), each kept token
        streamed as plain decoding would stream it (tokens past a finish are dropped); only the
        tokens plain decoding would have evaluated go into the cache, the other blocks go back."""
        proposal, s.proposal = s.proposal, []
        kept = verify(s.sampler, logits, proposal, s.history)
        s.draft.record(len(proposal), len(kept) - 1)
        s.stats.draft_n += len(proposal)
        s.stats.draft_n_accepted += len(kept) - 1
        n_past0 = s.kv.n_past
        chunks = []
        for j, tok in enumerate(kept):
            chunks.append(self._emit(s, tok, logits[j], n_past0 + j + 1))
            if chunks[-1].finish_reason is not None:
                break
        evaluated = ([s.next_token] + kept)[:len(chunks)]  # the tokens before each emitted one
        s.kv.commit(evaluated)
        s.kv.trim()
        s.n_done += len(evaluated)
        s.prompt += evaluated
        s.next_token = None
        for c in chunks[:-1]:
            s.request._put(c)
        self._deliver(s, chunks[-1])

    def _sample(self, s: SeqState, logits: np.ndarray) -> None:
        tok = s.sampler(logits, s.history)
        self._deliver(s, self._emit(s, tok, logits, s.kv.n_past))

    def _emit(self, s: SeqState, tok: int, logits: np.ndarray, n_past: int):
        """The chunk of s's sampled token `tok` (the sequence then holding n_past tokens), with
        the stats and history updated."""
        t = now()
        st = s.stats
        if s.stream.n == 0:
            s.t_first = t
            st.ttft_s = t - s.t_submit
            st.prompt_ms = 1000 * (t - s.t_admit)
            evaluated = st.prompt_tokens - st.cached_tokens
            st.prompt_tps = evaluated / max(t - s.t_admit, 1e-9)
        chunk = s.stream.push(tok, n_past)
        if s.logprobs is not None:
            lp, top = logprobs_of(logits, tok, s.logprobs)
            from dataclasses import replace

            chunk = replace(chunk, logprob=lp, top_logprobs=top)
        st.gen_tokens = s.stream.n
        self.counters["gen_tokens"] += 1
        if st.gen_tokens > 1:
            st.gen_ms = 1000 * (t - s.t_first)
            st.tpot_ms = st.gen_ms / (st.gen_tokens - 1)
            st.gen_tps = (st.gen_tokens - 1) / max(t - s.t_first, 1e-9)
        if s.decode_steps:
            st.device_ms = {d: 1000 * sec / s.decode_steps for d, sec in s.device_s.items()}
            st.crossings = s.crossings
        st.n_past = n_past
        s.history.append(tok)
        if s.lookup is not None:
            s.lookup.extend([tok])
        return chunk

    def _deliver(self, s: SeqState, chunk) -> None:
        """Hand s's chunk to its Request; a last chunk finishes s and frees its blocks."""
        st = s.stats
        if chunk.finish_reason is not None:
            st.finish_reason = chunk.finish_reason
            with self._cv:
                if s in self.running:
                    self.running.remove(s)
            self._release(s)
            self.counters["finished"] += 1
            s.request._put(chunk)
            return
        s.next_token = chunk.token
        s.request._put(chunk)
