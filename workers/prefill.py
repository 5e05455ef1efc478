"""Prefill TP worker: `torchrun ... -m workers.prefill --registry URL --group-id G`.

Each rank: join the TP group, agree on the engine_id with the registry, fill its share of the
KV cache with content that is a function of (engine, block, head), register it with NIXL,
publish its agent, then serve reads until SIGTERM, a deadline, or `--exit-after-notifs`
"verified" notifications from decode ranks. Shutdown deregisters and releases everything.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from registry_client.errors import EngineIdentityError, EngineIdMismatch
from workers import launch
from workers.endpoint import NixlEndpoint
from workers.kv import fill, kv_spec
from workers.settings import PrefillSettings, parse_prefill

log = logging.getLogger("workers.prefill")


def parse_args(argv: list[str] | None = None) -> PrefillSettings:
    return parse_prefill(argv, __doc__)


def serve(
    args: PrefillSettings,
    endpoint: NixlEndpoint,
    stop: threading.Event,
    reporter: launch.Reporter,
) -> int:
    """Poll notifications until told to stop; returns how many 'verified' ones came."""
    verified = 0
    readers: set[str] = set()
    deadline = time.monotonic() + args.serve_s
    while not stop.is_set() and time.monotonic() < deadline:
        for sender, messages in endpoint.notifications().items():
            for message in messages:
                log.info("notification from %s: %s", sender, message.decode(errors="replace"))
                if message.startswith(b"verified"):
                    verified += 1
                    readers.add(sender)
                    reporter.update(verified_notifs=verified, readers=sorted(readers))
        if args.exit_after_notifs and verified >= args.exit_after_notifs:
            log.info("%d verified reads reported: done serving", verified)
            break
        stop.wait(0.05)
    return verified


def run(args: PrefillSettings) -> int:
    session = launch.start_rank(args, "prefill")
    info, reporter, stop = session.info, session.reporter, session.stop
    layout, client = session.layout, session.client
    endpoint: NixlEndpoint | None = None
    publication = None
    superseded: list[EngineIdMismatch] = []
    try:
        try:
            identity = launch.establish_identity(args, client, info, "prefill", layout)
        except EngineIdentityError as exc:
            log.error("%s", exc)
            reporter.update(status="identity_failed", error=str(exc), causes=exc.causes)
            return launch.EXIT_IDENTITY
        reporter.update(
            engine_id=identity.engine_id,
            generation=identity.generation,
            engine_id_source=identity.source,
        )
        heads = layout.local_heads(info.world)
        cache = layout.allocate(info.world, layout.num_blocks, device=args.device)
        fill(cache, identity.engine_id, layout, info.world, info.rank)
        endpoint = NixlEndpoint(f"{identity.engine_id}-rank{info.rank}")
        endpoint.register(cache)

        def on_superseded(exc: EngineIdMismatch) -> None:
            superseded.append(exc)
            stop.set()

        try:
            publication = launch.publish(
                args,
                client,
                info,
                identity,
                endpoint,
                kv_spec(cache, heads),
                on_superseded,
                linger_s=args.serve_s,
            )
        except EngineIdentityError as exc:
            log.error("REGISTRY REFUSED THE AGENTS: %s", exc)
            reporter.update(status="refused", error=str(exc), causes=exc.causes)
            return launch.EXIT_REFUSED
        log.info(
            "serving engine %s generation %d: %d blocks x %d regions, %d heads (%d..%d), "
            "agent %s at %s",
            identity.engine_id,
            identity.generation,
            layout.num_blocks,
            layout.num_regions,
            heads,
            info.rank * heads,
            (info.rank + 1) * heads - 1,
            endpoint.name,
            publication.host,
        )
        reporter.update(
            status="serving",
            agent_name=endpoint.name,
            host=publication.host,
            kv_bytes=int(cache.numel() * cache.element_size()),
        )
        verified = serve(args, endpoint, stop, reporter)
        if superseded:
            reporter.update(status="superseded", error=superseded[0].detail)
            return launch.EXIT_SUPERSEDED
        reporter.update(status="done", verified_notifs=verified)
        return launch.EXIT_OK
    finally:
        if publication is not None:
            publication.close()
        if endpoint is not None:
            endpoint.close()
        session.close()
        log.info("shut down")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except Exception:
        logging.getLogger("workers").exception("prefill rank failed")
        return launch.EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
