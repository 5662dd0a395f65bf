"""One request, end to end: pick a prefill actor, prefill, pick a decode actor, stream.

Where prefill samples the first token (hybrids, prefill_worker/worker.py) it goes to the
caller as soon as prefill returns, and decode continues from it; a first token that ends
the request is never decoded.

Both legs start on this router's feed to the engine's actor (router/feeds.py), not as Ray
calls. The caller iterates `generate()`; leaving the iteration early (client cancel,
deadline) aborts the decode leg in its engine, which frees its blocks there; a prefill leg
is let finish, and its blocks freed then. A decode actor that dies mid-stream is, by
policy, replaced: the request is resumed (prompt + tokens already streamed) on another
decode actor, and the caller sees one uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Mapping

from messages.errors import (
    DecodeFailedError,
    FeedLostError,
    LegStalledError,
    NoWorkerError,
    PrefillTimeoutError,
    TransferFailedError,
)
from messages.reports import PrefixHit
from messages.requests import GenerateRequest, ModelLimits
from messages.results import FEED_HEARTBEAT_S, GenerationResult, PrefillResult, TokenChunk
from configuration.fields import knob
from messages.timings import LatencySummary, PhaseTimings
from messages.transfer import TransferBytes, TransferHandle
from router import metrics
from router.feeds import WorkerFeed
from router.journal import RequestJournal
from router.prefix_copies import PrefixCopies
from router.shadow_verification import ShadowVerifier, emitted_logprobs, without_logprobs
from cluster.pools import Member, Pool, RouteDecision

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterPolicy:
    # A failed transfer is vLLM's `load_failure_policy` first ("recompute": decode computes
    # the prompt itself and nothing reaches the router), then `transfer_retries`.
    on_decode_failure: Literal["migrate", "fail"] = knob(
        "migrate",
        help="a decode engine died or went silent (--stall-timeout-s) mid-stream: resume on another one, "
        "or end the stream with UNAVAILABLE",
    )
    max_migrations: int = knob(2, help="resumes one request may make before it fails")
    transfer_retries: int = knob(
        1,
        help="times a request is prefilled again when decode could not load its handed-off state (a transfer "
        "digest mismatch, a producer lost before the pull) before it fails with UNAVAILABLE",
    )
    # At least 3 on CPU hybrids: prefill may compute N-1 tokens and vLLM 0.32's CPU conv
    # kernel fails on 1-token prefills. vLLM's own kv_recompute_threshold is 64.
    local_prefill_below: int = knob(3, help="prompts shorter than this prefill on the decode engine (no transfer)")
    # Conditional disaggregation (Dynamo's max_local_prefill_length, made per request from the
    # decode engine's own prefix cache): a few missing tokens cost less to compute there than a
    # handoff. A hybrid's decode engine hits where it kept a state checkpoint: the prompts it
    # prefilled itself, and the block ends it decoded past (--state-checkpoint-tokens).
    local_prefill_uncached: int | None = knob(
        None,
        help="prefill on the decode engine when it lacks at most this many of the prompt's tokens (its prefix "
        "cache holds the rest; no handoff); unset: the break-even of --planner-model's prefill and transfer "
        "costs, or 0 (off) without one",
    )
    on_prefill_unavailable: Literal["local", "fail"] = knob(
        "local", help="no live prefill engine: prefill on the decode engine (degraded), or refuse with UNAVAILABLE"
    )
    prefill_timeout_s: float = knob(
        300.0, help="longest wait for a prefill leg, or for a decode leg's first token on a live engine"
    )
    stall_timeout_s: float = knob(
        120.0,
        help="a decode leg fails when its engine's feed (heartbeats included) is silent this long, "
        "or its tokens stop this long once begun",
    )
    release_timeout_s: float = knob(5.0, help="longest wait for a producer to free a request's blocks")
    cache_aware: bool = knob(
        True,
        help="with several engines in a pool, route by how much of the prompt each one's prefix cache holds "
        "(this router's copies of their indexes): an engine computing the prompt (prefill; colocated decode) is "
        "picked by the least work (uncached + queued uncached prompt tokens), decode after a handoff by the most held",
    )
    # 3 rather than 1: a popular document's requests then spread to an idle engine, which
    # keeps it too, instead of piling onto the one engine holding it (docs/benchmarks.md,
    # "Streams decoding on an engine weigh three times").
    decoding_stream_weight: float = knob(
        3.0,
        help="engines that prefill and decode (colocated; a decode engine prefilling): each stream on one "
        "counts this share of a new prompt's uncached tokens against it, since the prompt's prefill steps hold "
        "that stream's next token (0: the prompt's own work alone, which draws requests sharing a prefix to one "
        "engine; higher: a prompt cached on a busy engine goes to an idle one sooner, which then holds it too)",
    )
    index_copy_wait_s: float = knob(
        0.05,
        help="longest a request waits for this router's copy of a new engine's prefix index "
        "(until then the engine counts as holding nothing)",
    )
    decode_cache_slack: int = knob(
        1,
        help="after a handoff, a decode engine holding more of the prompt wins if it runs at most this many more "
        "requests",
    )
    verify_fraction: float = knob(
        0.0,
        help="share of requests the decode engine recomputes colocated, teacher-forced along P/D's tokens, "
        "to check the handoff (pdserve_shadow_checks_total); 0 turns it off",
    )
    verify_tokens: int = knob(16, help="generated tokens each shadow check scores")

    def __post_init__(self) -> None:
        if self.on_decode_failure not in ("migrate", "fail"):
            raise ValueError(f"on_decode_failure {self.on_decode_failure!r}: use 'migrate' or 'fail'")
        if self.on_prefill_unavailable not in ("local", "fail"):
            raise ValueError(f"on_prefill_unavailable {self.on_prefill_unavailable!r}: use 'local' or 'fail'")
        if self.decoding_stream_weight < 0:
            raise ValueError(f"decoding_stream_weight must be >= 0, got {self.decoding_stream_weight}")
        if self.decode_cache_slack < 0:
            raise ValueError(f"decode_cache_slack must be >= 0, got {self.decode_cache_slack}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.transfer_retries < 0:
            raise ValueError(f"transfer_retries must be >= 0, got {self.transfer_retries}")
        if not 0 <= self.verify_fraction <= 1:
            raise ValueError(f"verify_fraction must be in [0, 1], got {self.verify_fraction}")
        if self.verify_tokens < 1:
            raise ValueError(f"verify_tokens must be >= 1, got {self.verify_tokens}")
        if self.local_prefill_uncached is not None and self.local_prefill_uncached < 0:
            raise ValueError(f"local_prefill_uncached must be >= 0 (0: off), got {self.local_prefill_uncached}")
        if self.local_prefill_below < 3:
            raise ValueError(
                f"local_prefill_below {self.local_prefill_below}: at least 3 "
                "(a hybrid's 1-token prefill hangs vLLM's CPU engine)"
            )
        for name in ("prefill_timeout_s", "stall_timeout_s", "release_timeout_s", "index_copy_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.stall_timeout_s < 3 * FEED_HEARTBEAT_S:
            raise ValueError(
                f"stall_timeout_s {self.stall_timeout_s}: at least {3 * FEED_HEARTBEAT_S:.0f} "
                f"(a decode engine's feed speaks every {FEED_HEARTBEAT_S:.0f} s: shorter would fail live engines)"
            )


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """Where a leg's prompt is prefilled, and why: on a prefill engine (`route`), or by the
    decode engine itself (`route` None); `decode`: that engine, when the plan chose it for
    what its prefix cache holds."""

    route: RouteDecision | None
    reason: Literal[
        "prefill pool", "colocated", "short prompt", "cached on decode", "prompt logprobs", "no live prefill engine"
    ]
    decode: RouteDecision | None = None


@dataclass(frozen=True, slots=True)
class Failover:
    """What becomes of a stream whose decode engine died, and why."""

    action: Literal["migrate", "fail"]
    reason: str
    migrations: int  # made before this failure


@dataclass(slots=True)
class _Progress:
    """What the caller has been sent so far."""

    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str = "abort"
    # Of the first leg's prompt: the prefill engine's prefix-cache hits, or the decode
    # engine's where it prefilled the prompt itself.
    cached_tokens: int | None = None
    drafts: tuple[int, int] = (0, 0)  # (proposed, accepted), every leg's

    def add(self, chunk: TokenChunk) -> None:
        now = time.perf_counter()
        self.token_ids.extend(chunk.token_ids)
        self.token_times.extend([now] * len(chunk.token_ids))
        if self.cached_tokens is None:
            self.cached_tokens = chunk.cached_tokens
        if chunk.drafts:
            self.drafts = (self.drafts[0] + chunk.drafts[0], self.drafts[1] + chunk.drafts[1])
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason


class Orchestrator:
    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        limits: ModelLimits,
        policy: RouterPolicy = RouterPolicy(),
        journal: RequestJournal | None = None,
    ) -> None:
        """`journal`: record traffic for the controller's planner (routers in front of one)."""
        self.prefill = prefill
        self.journal = journal
        self.decode = decode
        self.limits = limits
        self.policy = policy
        # No prefill pool at all: colocated serving (the decode engines prefill locally),
        # the baseline disaggregation is measured against, behind the same router.
        self.colocated = not prefill.members
        self._background: set[asyncio.Task[None]] = set()  # releases in flight
        # One feed per worker actor for this router (router/feeds.py): its legs start there
        # and their outputs (decode's batched tokens, prefill's results) come back there.
        self._feeds: dict[str, WorkerFeed] = {}
        self.shadow = ShadowVerifier(policy.verify_fraction, policy.verify_tokens) if policy.verify_fraction else None
        self.prefix_copies = PrefixCopies()
        if policy.cache_aware:  # started now, ready by the first request
            self.prefix_copies.follow(prefill.live + decode.live)

    def close(self) -> None:
        """Stop following the engines' prefix indexes (their threads end within a poll)."""
        self.prefix_copies.close()

    async def close_feeds(self) -> None:
        """End the worker feeds opened on the running loop, whose actors then abort what they
        still carry. A front that stops while others share this orchestrator (in-process
        stacks) leaves their feeds, each on its own loop, as they are."""
        loop = asyncio.get_running_loop()
        mine = [name for name, feed in self._feeds.items() if feed.loop is loop]
        await asyncio.gather(*(self._feeds.pop(name).aclose() for name in mine))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk | GenerationResult]:
        arrived = time.perf_counter()
        arrived_wall = self.journal.arrived() if self.journal else 0.0
        request.validate(self.limits)  # cheap, and before any engine holds blocks for it
        progress = _Progress()
        first_leg: tuple[PrefillResult | None, float] | None = None  # the leg the timings describe
        migrations = retries = 0
        decode_member: Member | None = None
        shadowed = self.shadow is not None and self.shadow.wants(request)
        served: list[float] = []  # the emitted tokens' logprobs, for the shadow check
        predicted: int | None = None  # the first leg's prefix-cache hit, as its engine's index said

        def out(chunk: TokenChunk) -> TokenChunk:
            if not shadowed:
                return chunk
            served.extend(emitted_logprobs(chunk))
            return chunk if request.sampling.logprobs is not None else without_logprobs(chunk)

        # A checked request asks the engines for its tokens' logprobs (the client sees none
        # unless it asked).
        legs = ShadowVerifier.instrumented(request) if shadowed else request
        current = legs
        while True:
            # Engines see a fresh id per leg (prefill + decode, or a migration's resume):
            # clients' ids are theirs to repeat; they are kept for display and logs only.
            leg = dataclasses.replace(current, request_id=f"{request.request_id[:48]}-{uuid.uuid4().hex[:12]}")
            first_pass = first_leg is None
            prefill_member, prefill, plan = await self._prefill_or_local(leg)
            first_leg = first_leg or (prefill, time.perf_counter())
            if first_pass and plan.route is not None:
                predicted = plan.route.cached_tokens
            if prefill is not None and progress.cached_tokens is None:
                progress.cached_tokens = prefill.cached_tokens
            handle = prefill.handle if prefill else None
            first = prefill.first if prefill else None  # sampled by prefill: out at once
            if first is not None and first.finish_reason is not None:  # and it was the last
                progress.add(first)
                try:
                    yield out(first)
                finally:
                    self._release_soon(handle)
                break
            if first is not None:
                leg = prefill.decode_leg(leg)
            try:
                route = await self._decode_route(leg, plan, handed_off=prefill is not None)
            except NoWorkerError:
                if handle is not None:
                    self._release_soon(handle)
                raise
            _routed(leg.request_id, route)
            if first_pass and prefill is None:  # decode prefills: its own answer is the prediction
                predicted = route.cached_tokens
            decode_member = route.member
            try:
                uncached = 0 if prefill else len(leg.prompt_token_ids) - (route.cached_tokens or 0)
                async for chunk in self._decode(decode_member, leg, handle, progress, first, uncached):
                    yield out(chunk)
                break
            # Decode refused the pulled state before running on it (its digests did not match
            # the producer's, or the producer went before the pull): the engine is fine, the
            # handoff is not. Prefill again, from the tokens the client already has.
            except TransferFailedError as err:
                if retries >= self.policy.transfer_retries:
                    raise
                retries += 1
                metrics.HANDOFF_RETRIES.inc()
                log.warning(
                    "%s: decode %s could not load the handoff (%s): prefilling again",
                    request.request_id,
                    decode_member.name,
                    err,
                )
                current = legs.continued(tuple(progress.token_ids))
                if current.sampling.max_tokens < 1:  # prefill's token was the last
                    progress.finish_reason = "length"
                    break
            # The decode actor died, or went silent (stuck, or cut off from this router): out of
            # this router's rotation until a load poll reaches it again.
            except (FeedLostError, LegStalledError) as err:
                decode_member.mark_dead(f"failed serving {leg.request_id}: {type(err).__name__}")
                failover = self.failover(
                    migrations, grammar_started=bool(progress.token_ids) and leg.sampling.structured is not None
                )
                metrics.FAILOVERS.labels(failover.action).inc()
                log.warning("%s: decode %s failed (%s): %s", request.request_id, decode_member.name, err, failover)
                if failover.action == "fail":
                    raise DecodeFailedError(
                        f"decode actor {decode_member.name} failed while serving {request.request_id}: {err}"
                    ) from err
                migrations += 1
                current = legs.continued(tuple(progress.token_ids))
                if current.sampling.max_tokens < 1:  # it died after the last token
                    progress.finish_reason = "length"
                    break

        result = GenerationResult(
            finish_reason=progress.finish_reason,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=len(progress.token_ids),
            timings=_timings(arrived, *first_leg, progress.token_times),
            prefill_worker=prefill_member.name if prefill_member else "",
            decode_worker=decode_member.name if decode_member else "",
            migrations=migrations,
            cached_tokens=progress.cached_tokens or 0,
            draft_tokens=progress.drafts[0],
            accepted_draft_tokens=progress.drafts[1],
        )
        if predicted is not None:
            metrics.observe_prediction(predicted, result.cached_tokens)
        # Only a single P/D leg is checked: a migrated or locally prefilled stream has no one
        # handoff to blame.
        if shadowed and migrations == retries == 0 and prefill is not None and decode_member is not None:
            self.shadow.start(
                legs, progress.token_ids, served, prefill_member.name, decode_member.name, decode_member.actor
            )
        times = progress.token_times
        metrics.observe_request(result, [b - a for a, b in zip(times, times[1:])])
        if self.journal:
            self.journal.finished(arrived_wall, result)
        yield result

    def failover(self, migrations: int, grammar_started: bool = False) -> Failover:
        """Migrate the stream or fail it, by policy and the migrations it made already.
        `grammar_started`: a structured output was streamed in part; its grammar's state was
        on the lost engine, and vLLM cannot start a grammar part-way, so it cannot resume."""
        limit = self.policy.max_migrations
        if self.policy.on_decode_failure == "fail":
            return Failover("fail", "policy on_decode_failure is fail", migrations)
        if grammar_started:
            return Failover("fail", "a structured output cannot resume part-way on another engine", migrations)
        if migrations >= limit:
            return Failover("fail", f"it migrated {migrations} times, max_migrations is {limit}", migrations)
        return Failover("migrate", f"migration {migrations + 1} of at most {limit}", migrations)

    def plan_prefill(
        self,
        request: GenerateRequest,
        cached: Mapping[str, PrefixHit] | None = None,
        decode_cached: Mapping[str, PrefixHit] | None = None,
    ) -> PrefillPlan:
        """Prefill on the prefill pool, or (colocated, short prompt, a decode engine that lacks
        at most `local_prefill_uncached` of it, prompt logprobs of a request decode samples
        whole, or no live prefill engine under policy "local") leave the prompt to a decode
        engine. `cached` / `decode_cached`: what each prefill / decode engine holds of the
        prompt, by name (`cached_prefixes`). No I/O."""
        if self.colocated:
            return PrefillPlan(None, "colocated")
        prompt = len(request.prompt_token_ids)
        if prompt < self.policy.local_prefill_below or prompt <= (self.policy.local_prefill_uncached or 0):
            return PrefillPlan(None, "short prompt")
        if request.sampling.prompt_logprobs is not None and request.sampling.decoded_whole:
            # Prefill would stop one prompt token short (kv_transfer/producer.py), so the
            # last token's logprob would be missing: the engine that computes it all returns them.
            return PrefillPlan(None, "prompt logprobs")
        if decode_cached and self.policy.local_prefill_uncached:
            with contextlib.suppress(NoWorkerError):  # none live: the decode pick says so
                route = self.decode.pick_decode(decode_cached, self.policy.decode_cache_slack)
                if prompt - (route.cached_tokens or 0) <= self.policy.local_prefill_uncached:
                    return PrefillPlan(None, "cached on decode", route)
        try:
            return PrefillPlan(self.prefill.pick_prefill(prompt, cached), "prefill pool")
        except NoWorkerError:
            if self.policy.on_prefill_unavailable == "fail":
                raise
            return PrefillPlan(None, "no live prefill engine")

    async def _decode(
        self,
        member: Member,
        request: GenerateRequest,
        handle: TransferHandle | None,
        progress: _Progress,
        first: TokenChunk | None,
        uncached_tokens: int,
    ) -> AsyncIterator[TokenChunk]:
        """Stream the decode leg; `first` (prefill's token) goes out while the leg starts.
        `uncached_tokens`: the prompt tokens it computes first (none when handed off)."""
        async with self.decode.in_flight(member, prompt_tokens=uncached_tokens) as counted:
            feed = self._feed(member)
            member.feed = feed.subscriber  # its load reports count this router's legs by it
            inbox = feed.open_leg(request.request_id)
            started = finished = False
            try:
                await feed.opened()
                feed.start_leg(request, handle)
                if first is not None:
                    progress.add(first)
                    yield first
                while not finished:
                    chunks: list[TokenChunk] = []
                    for event in await inbox.take():
                        if isinstance(event, BaseException):  # the feed broke (the actor died) or it stalled
                            raise event
                        if event.error is not None:
                            raise event.error
                        chunks.append(event.output)
                    # Tokens that arrived together (this stream's caller was still writing the
                    # last ones) go out as one message: fewer writes, and no token waits longer.
                    chunk = chunks[0] if len(chunks) == 1 else TokenChunk.joined(chunks)
                    if not started:
                        counted.prefilled()
                    started = True
                    progress.add(chunk)
                    finished = chunk.finish_reason is not None
                    yield chunk
            finally:
                feed.close_leg(request.request_id)
                if not finished:  # caller left early or it failed: stop the engine too
                    feed.abort_leg(request.request_id)
                if handle is not None and not started:
                    # Cancelled or failed before decode produced anything: the producer may
                    # still hold the blocks; have it free them now, not at lease expiry.
                    self._release_soon(handle)

    def _feed(self, member: Member) -> WorkerFeed:
        """This router's feed from `member`, reopened after the actor restarted."""
        feed = self._feeds.get(member.name)
        if feed is None or not feed.usable or feed.actor != member.actor:
            if feed is not None:
                feed.close()
            policy = self.policy
            feed = WorkerFeed(
                member.name,
                member.actor,
                policy.stall_timeout_s,
                policy.prefill_timeout_s,
                lambda orphan: self._release_soon(orphan.handle),
            )
            self._feeds[member.name] = feed
        return feed

    async def cached_prefixes(
        self, pool: Pool, request: GenerateRequest, state_pulled: bool = False, even_one: bool = False
    ) -> dict[str, PrefixHit]:
        """How much of the prompt each live engine of `pool` holds in its prefix cache, when
        there is a choice to make (`even_one`: of a single engine too), from this router's
        copies of their indexes; `state_pulled`: for decode legs that pull the prompt's state."""
        live = pool.live
        if not self.policy.cache_aware or len(live) < (1 if even_one else 2):
            return {}
        started = time.perf_counter()
        prompt, salt = request.prompt_token_ids, request.cache_salt
        hits = await self.prefix_copies.hits(live, prompt, salt, state_pulled, self.policy.index_copy_wait_s)
        metrics.PREFIX_LOOKUP.labels(pool.role).observe(time.perf_counter() - started)
        return hits

    async def _prefill_or_local(
        self, request: GenerateRequest
    ) -> tuple[Member | None, PrefillResult | None, PrefillPlan]:
        """Prefill where `plan_prefill` says; a prefill actor that dies meanwhile is marked
        and the leg planned again."""
        while True:
            prefill_cached = await self.cached_prefixes(self.prefill, request)
            decode_cached = await self._decode_holdings(request)
            plan = self.plan_prefill(request, prefill_cached, decode_cached)
            metrics.PREFILL_PLANS.labels(plan.reason).inc()
            if plan.route is None:
                log.debug("%s: prefill on the decode engine (%s)", request.request_id, plan.reason)
                if plan.reason == "no live prefill engine":
                    metrics.LOCAL_PREFILL_FALLBACKS.inc()
                return None, None, plan
            _routed(request.request_id, plan.route)
            member = plan.route.member
            try:
                uncached = len(request.prompt_token_ids) - (plan.route.cached_tokens or 0)
                return member, await self._prefill(member, request, uncached), plan
            except (FeedLostError, LegStalledError) as err:  # the actor died, or went silent
                member.mark_dead(f"failed prefilling {request.request_id}: {type(err).__name__}")

    async def _decode_route(self, leg: GenerateRequest, plan: PrefillPlan, handed_off: bool) -> RouteDecision:
        """Where a decode leg goes: where the plan put it; else, if that engine computes the
        prompt itself (colocated, a short prompt, no prefill engine), the least prefill work,
        as the prefill pool picks, since a queued prompt delays the next one's first token
        and decoding streams barely do; else, for a handoff, the decode pick."""
        if plan.decode is not None:
            return plan.decode
        if not handed_off:
            cached = await self.cached_prefixes(self.decode, leg)
            return self.decode.pick_prefill(len(leg.prompt_token_ids), cached, self.policy.decoding_stream_weight)
        cached = await self.cached_prefixes(self.decode, leg, state_pulled=True)
        return self.decode.pick_decode(cached, self.policy.decode_cache_slack)

    async def _decode_holdings(self, request: GenerateRequest) -> dict[str, PrefixHit]:
        """What each decode engine holds of a prompt it might prefill itself (conditional
        disaggregation on); not asked when the answer could not change the plan."""
        limit, prompt = self.policy.local_prefill_uncached or 0, len(request.prompt_token_ids)
        if self.colocated or not limit or prompt <= limit or prompt < self.policy.local_prefill_below:
            return {}
        return await self.cached_prefixes(self.decode, request, even_one=True)

    async def _prefill(self, member: Member, request: GenerateRequest, uncached_tokens: int) -> PrefillResult:
        """The prefill leg on `member`, which computes `uncached_tokens` of the prompt (its queue's
        measure for the next pick)."""
        async with self.prefill.in_flight(member, prompt_tokens=uncached_tokens):
            feed = self._feed(member)
            pending = feed.prefill(request)
            try:
                return await asyncio.wait_for(asyncio.shield(pending), self.policy.prefill_timeout_s)
            except FeedLostError:
                raise  # the actor died: its blocks are gone
            except LegStalledError:
                # Silent (stuck, or cut off): should it speak again, the leg stops; a result
                # that came first frees its blocks (the feed's orphaned prefill).
                feed.abort_leg(request.request_id)
                raise
            except asyncio.TimeoutError:
                feed.abort_leg(request.request_id)  # its last word settles `pending`
                self._release_when_done(pending)
                raise PrefillTimeoutError(
                    f"prefill actor {member.name} did not finish within {self.policy.prefill_timeout_s:.0f}s"
                ) from None
            except BaseException:
                # The caller left (cancel, deadline). Aborting is no use here: a prefill is
                # often one engine step, which completes anyway and then holds its blocks for a
                # decode that never comes until the lease runs out. Let it finish; free them then.
                self._release_when_done(pending)
                raise

    def _release_when_done(self, pending: asyncio.Future[PrefillResult]) -> None:
        def release(done: asyncio.Future[PrefillResult]) -> None:
            if not done.cancelled() and done.exception() is None:
                self._release_soon(done.result().handle)

        pending.add_done_callback(release)

    def _release_soon(self, handle: TransferHandle) -> None:
        """Ask a live decode actor to tell the producer to free `handle`'s blocks (runs on
        its own: the caller may be a cancelled request)."""

        async def release() -> None:
            try:
                member = self.decode.pick_decode().member
                await asyncio.wait_for(member.actor.release_transfer.remote(handle), self.policy.release_timeout_s)
            except Exception:  # the lease still frees them; never fail a request over it
                log.warning("could not release %s on %s early", handle.request_id, handle.engine_id, exc_info=True)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _routed(request_id: str, route: RouteDecision) -> None:
    metrics.ROUTES.labels(route.pool, route.reason).inc()
    if route.cached_tokens is not None and route.pool == "prefill":
        metrics.PREDICTED_CACHED_TOKENS.inc(route.cached_tokens)
    log.debug("%s: %s", request_id, route)


def _timings(arrived: float, prefill: PrefillResult | None, prefill_done: float, times: list[float]) -> PhaseTimings:
    first = times[0] if times else time.perf_counter()
    span = times[-1] - first if len(times) > 1 else 0.0
    prefill_s = prefill.prefill_s if prefill else 0.0
    # The handoff ends at decode's first token, which follows any token prefill sampled;
    # a request that prefill's token ended moved nothing.
    from_prefill = len(prefill.first.token_ids) if prefill and prefill.first else 0
    decoded = prefill is not None and len(times) > from_prefill
    return PhaseTimings(
        queue_s=max(0.0, (prefill_done - arrived) - prefill_s),
        prefill_s=prefill_s,
        transfer_s=times[from_prefill] - prefill_done if decoded else 0.0,
        ttft_s=first - arrived,
        inter_token=LatencySummary.of([b - a for a, b in zip(times, times[1:])]),
        decode_tokens_per_s=(len(times) - 1) / span if span > 0 else 0.0,
        e2e_s=time.perf_counter() - arrived,
        transfer_bytes=prefill.handle.bytes if decoded else TransferBytes(0, 0),
    )
