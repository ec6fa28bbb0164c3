"""Which secret an instance authenticates its peers with: configured, per host, or none.

Called once per engine start by the settings layers (the vLLM connector's
``VllmSettings.secret``, ``kvbridge serve`` and the reference engine's
``connector_host.build``); the agent only ever sees the bytes.

``cluster_secret`` decides, in this order:

1. a configured secret: ``secret_file``, else ``$KVBRIDGE_SECRET``
   (``security.load_cluster_secret``), for P and D on several hosts;
2. none, when the operator said ``insecure`` (logged as a warning, every start);
3. refusal (``ConfigError``) when the advertised ``host`` is not loopback:
   peers on other hosts cannot know a secret made on this one;
4. the *host secret*: 32 random bytes (from ``secrets``) that every instance
   run by the same user on this host shares, created on first use in a
   directory only that user may enter (``host_secret``). So the zero-config
   commands in the README are authenticated: another user's processes (or
   containers not sharing the directory) cannot read it, and are refused.

Files::

    $KVBRIDGE_SECRET_DIR, else $XDG_CACHE_HOME/kvbridge, else ~/.cache/kvbridge
        (mode 700, owned by this user)
      secret          64 hex characters and a newline, mode 600

Creation is atomic: the secret is written to a fresh temporary file (``O_EXCL``)
then hard-linked to ``secret``; the first link wins, and every process reads
whatever won, so two instances starting at once agree. A directory or file
with another owner, group/other permissions, or a symlink is refused with a
message naming the path and the fix, never used or repaired.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from kvbridge.errors import ConfigError
from kvbridge.transfer.protocol.security import MIN_SECRET_NBYTES, load_cluster_secret

__all__ = ["SECRET_DIR_ENV", "cluster_secret", "host_secret", "host_secret_dir", "is_loopback"]

logger = logging.getLogger(__name__)

SECRET_DIR_ENV = "KVBRIDGE_SECRET_DIR"
_FILE_NAME = "secret"
_NBYTES = 32


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``).

    Any other name counts as reachable from other hosts (it is not resolved:
    what a name resolves to may change after start).
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_secret_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where this user's host secret lives (see the module docstring)."""
    env = os.environ if environ is None else environ
    if env.get(SECRET_DIR_ENV):
        return Path(env[SECRET_DIR_ENV])
    cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(cache) / "kvbridge"


def _fix_for(path: Path) -> str:
    return (f"remove it (a new one is made on the next start), or point ${SECRET_DIR_ENV} at "
            f"a directory of your own")


def _check_private(path: Path, st: os.stat_result, *, directory: bool) -> None:
    """Refuse ``path`` unless it is ours, of the right kind, with no group/other bits."""
    kind = "directory" if directory else "file"
    if stat.S_ISLNK(st.st_mode) or (stat.S_ISDIR(st.st_mode) != directory) or (
            not directory and not stat.S_ISREG(st.st_mode)):
        raise ConfigError(f"kvbridge host secret {kind} {str(path)!r} is not a plain {kind}: "
                          f"{_fix_for(path)}")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"kvbridge host secret {kind} {str(path)!r} belongs to uid "
                          f"{st.st_uid}, not to this user (uid {os.geteuid()}): another user "
                          f"may know the secret; {_fix_for(path)}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        want = "700" if directory else "600"
        raise ConfigError(f"kvbridge host secret {kind} {str(path)!r} has mode {mode:o}: other "
                          f"users may read it; chmod {want} {str(path)!r} if nobody else could "
                          f"have read it yet, else {_fix_for(path)}")


def _create(path: Path) -> None:
    """Write a fresh secret next to ``path`` and link it there unless one won the race."""
    tmp = path.with_name(f".{_FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, secrets.token_hex(_NBYTES).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another instance made it first:
            os.link(tmp, path)  # everyone uses that one
    finally:
        tmp.unlink(missing_ok=True)


def host_secret(directory: Path | None = None, *,
                environ: Mapping[str, str] | None = None) -> bytes:
    """The secret every instance of this user on this host shares; made on first use.

    Args:
        directory: where it lives (default :func:`host_secret_dir`).
        environ: environment to read (default ``os.environ``).

    Returns:
        The secret's bytes (64 hex characters).

    Raises:
        ConfigError: the directory or file cannot be made or read, or is not
            private to this user (the message names the path and the fix).
    """
    folder = directory if directory is not None else host_secret_dir(environ)
    path = folder / _FILE_NAME
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        _check_private(folder, os.lstat(folder), directory=True)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            _create(path)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            _check_private(path, os.fstat(fd), directory=False)
            secret = os.read(fd, 4096).strip()
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(
            f"cannot make or read the kvbridge host secret in {str(folder)!r}: {exc}; set "
            f"${SECRET_DIR_ENV} to a directory this user may write, or configure a cluster "
            f"secret (secret_file / $KVBRIDGE_SECRET)") from exc
    if len(secret) < MIN_SECRET_NBYTES:
        raise ConfigError(f"kvbridge host secret {str(path)!r} holds {len(secret)} bytes, fewer "
                          f"than {MIN_SECRET_NBYTES}: {_fix_for(path)}")
    return secret


def cluster_secret(
    host: str,
    *,
    secret_file: str | Path | None = None,
    insecure: bool = False,
    environ: Mapping[str, str] | None = None,
    secret_dir: Path | None = None,
    fix: str = "set secret_file (or $KVBRIDGE_SECRET), or \"insecure\": true",
) -> bytes | None:
    """The secret this instance's agents prove and demand; None only when ``insecure``.

    Args:
        host: the address this instance advertises to its peers.
        secret_file: a configured secret file (else ``$KVBRIDGE_SECRET``).
        insecure: run without authentication when nothing is configured.
        environ: environment to read (default ``os.environ``).
        secret_dir: the host secret's directory (default :func:`host_secret_dir`).
        fix: how the caller's user configures a secret or ``insecure``, for the
            refusal's message (e.g. the command-line flags).

    Returns:
        The secret's bytes; None when ``insecure`` and none is configured.

    Raises:
        ConfigError: a non-loopback ``host`` with neither a configured secret nor
            ``insecure``; or a configured or host secret that cannot be used.
    """
    configured = load_cluster_secret(secret_file=secret_file, environ=environ)
    if configured is not None:
        return configured
    if insecure:
        logger.warning(
            "kvbridge runs WITHOUT authentication (insecure): any process that reaches this "
            "instance's transfer ports (advertised at %s) may read and write its KV cache. "
            "Configure a cluster secret on every P and D instead", host)
        return None
    if not is_loopback(host):
        raise ConfigError(
            f"host {host!r} is reachable from other hosts, and no cluster secret is set: peers "
            f"there cannot know this host's own secret. Put one random secret on every P and D "
            f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))' > secret; chmod 600 "
            f"secret): {fix} to run without authentication on a network you trust")
    return host_secret(secret_dir, environ=environ)
