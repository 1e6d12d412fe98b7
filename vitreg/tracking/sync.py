"""`vitreg sync`: spools whose run ended without the store holding all of it, delivered later, exactly once;
a spool is removed only when the store's run, counted after, lacks nothing and has ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import urllib.parse
from pathlib import Path

from vitreg.errors import VitregError
from vitreg.tracking.delivery import Delivery, seq_tag
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.spool import Spool, SpoolBusy, SpoolDamaged, SpoolUnusable, spool_root
from vitreg.tracking.store import first_line, short_http_requests
from vitreg.tracking.uris import redact


class SyncError(VitregError):
    """The tracking store did not take a spool."""


@dataclasses.dataclass(frozen=True)
class Synced:
    spool: Path
    run_id: str | None  # None: left alone (in use by a running process)
    records: int  # journal records delivered by this sync (0 when the server already had them all)
    ended: bool = True  # False: the spool holds no end and the store's run is RUNNING (the spool is kept)

    def describe(self) -> str:
        if self.run_id is None:
            return f"left {self.spool}: in use by a running process, which delivers it itself"
        if not self.ended:
            return (f"delivered {self.records} new records of {self.spool} -> run {self.run_id}, but not its end: "
                    f"its process stopped before writing it, so the run stays RUNNING and the spool is kept; "
                    f"end the run with `vitreg runs --stale --fix`, then `vitreg sync` removes the spool")
        return f"delivered {self.spool} -> run {self.run_id} ({self.records} new records)"


#: What MLflow sends to any http(s) tracking server from the environment, whatever the URI says.
SENT_CREDENTIALS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_USERNAME")


def _target_uri(spool: Spool, tracking_uri: str | None) -> str:
    """Where a spool goes: ``--tracking-uri``, else the server it was logged against, else the current one. A
    spool is data from disk: with credentials in the environment, one naming another http(s) host than
    MLFLOW_TRACKING_URI is refused until ``--tracking-uri`` says where it goes."""
    if tracking_uri:
        return tracking_uri
    current = mlflow.get_tracking_uri()
    recorded = spool.run_record.get("tracking_uri")
    if not recorded:
        return current
    if _host(recorded) and _host(recorded) != _host(current) and any(os.environ.get(v) for v in SENT_CREDENTIALS):
        raise SpoolDamaged(f"the spool {spool.path} names the tracking server {redact(recorded)}, not "
                           f"MLFLOW_TRACKING_URI's ({redact(current)}): this environment's credentials are not sent "
                           f"to a server a spool names; deliver it with `vitreg sync --spool {spool.path} "
                           f"--tracking-uri URI` once you know where it belongs")
    return recorded


def _host(uri: str) -> str | None:
    parts = urllib.parse.urlsplit(uri)
    return parts.netloc.rpartition("@")[2].lower() if parts.scheme in ("http", "https") else None


def sync_one(spool: Spool, tracking_uri: str | None = None) -> Synced:
    """Deliver one spool (locking it): :class:`SpoolBusy`, :class:`SpoolDamaged` (before sending anything), or
    :class:`SyncError` when the store's run, counted after, lacks anything the spool held."""
    spool.lock()
    try:
        records = spool.records()  # every record checked before the first is sent
        delivery = Delivery(spool, mlflow.MlflowClient(tracking_uri=_target_uri(spool, tracking_uri)))
        delivery.connect()
        new = sum(r["seq"] > delivery.delivered_seq and r["kind"] != "run" for r in records)
        delivery.push(records)
        lacking = delivery.shortfall(records)
        if lacking:  # the store lost something it had acknowledged: everything once more (it keeps one copy)
            delivery.delivered_seq = -1
            delivery.push(records)
            lacking = delivery.shortfall(records)
        if lacking:
            delivery.client.set_tag(delivery.run_id, seq_tag(spool.run_record["spool_id"]), "-1")  # all, next time
            raise SyncError(f"the tracking store's run {delivery.run_id} lacks {lacking} after delivering the "
                            f"spool {spool.path} twice: the spool is kept; check the store, then run `vitreg sync` "
                            f"again")
        # a spool without its end (a process killed, or failed before the end) is not all of the run: it is
        # kept until the store's run has ended some other way (runs --stale --fix), never called delivered
        ended = records[-1]["kind"] == "end" or delivery.client.get_run(delivery.run_id).info.status != "RUNNING"
    finally:
        spool.release()
    if ended:
        spool.remove()
        delivery.tidy_up()
    return Synced(spool.path, delivery.run_id, new, ended)


def pending(spool_dir: Path | None = None) -> list[Spool]:
    return Spool.find(Path(spool_dir) if spool_dir else spool_root())


def _left(spool_dir: Path | None) -> str:
    spools = pending(spool_dir)
    records = []
    for spool in spools:
        with contextlib.suppress(SpoolDamaged):  # counted as a run; its own sync says what is wrong
            records += [r for r in spool.records() if r["kind"] != "run"]
    points = sum(len(r.get("metrics", ())) for r in records)
    return f"{len(spools)} run(s) under {spool_dir or spool_root()} ({len(records)} records, {points} metric points)"


def sync(spool_dir: Path | None = None, tracking_uri: str | None = None) -> list[Synced]:
    """Deliver every spool under ``spool_dir`` (a spool folder, or a folder of them); :class:`SyncError` at the
    first the store does not take (those delivered before it stay delivered)."""
    if spool_dir is not None and not Path(spool_dir).is_dir():
        raise SyncError(f"there is no spool at {spool_dir} (no such folder): what it held is lost, or the path is "
                        f"wrong; `vitreg sync` without --spool delivers every spool under {spool_root()}")
    done, refused = [], []
    with short_http_requests():
        for spool in pending(spool_dir):
            try:
                done.append(sync_one(spool, tracking_uri))
            except SpoolBusy:
                done.append(Synced(spool.path, None, 0))
            except (SpoolDamaged, SpoolUnusable) as exc:  # this spool only: the others are still delivered
                refused.append(exc)
            except SyncError:
                raise
            except Exception as exc:  # noqa: BLE001 - unreachable, 5xx, refused: say so in one line
                raise SyncError(f"the tracking store at {redact(_target_uri(spool, tracking_uri))} did not take "
                                f"the spool {spool.path} ({first_line(exc)}); still spooled: "
                                f"{_left(spool_dir)}; run `vitreg sync` again when the store is back") from None
    if refused:
        more = f" ({len(refused) - 1} more spool(s) refused likewise)" if len(refused) > 1 else ""
        delivered = f"; delivered {len(done)} other spool(s)" if done else ""
        raise type(refused[0])(f"{refused[0]}{more}{delivered}")
    return done
