"""`inflight download SOURCE DEST`. The HTTP client is imported inside the handler."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from inflight.download.errors import MEANINGS, PERMANENT, DownloadError, ExitCode

EXIT_CODES = "exit codes:\n" + "\n".join(f"  {int(code)}  {meaning}" for code, meaning in MEANINGS.items())
DESCRIPTION = (
    "Fetch what `inflight serve` needs (config, tokenizer and generation files, the *.safetensors weights "
    "and their index, or one named GGUF file) into DEST. Interrupted files resume (HTTP Range on "
    "NAME.part); every file is checked against the Hub's size and sha256; a complete DEST is marked and a "
    "later run returns at once. HF_ENDPOINT selects a mirror. See docs/model-cache.md."
)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "download",
        help="fetch a model's files from the Hugging Face Hub or S3 (resumable, verified)",
        description=textwrap.fill(DESCRIPTION, 100),
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source",
        help="hf://ORG/REPO, hf://ORG/REPO/FILE.gguf, s3://BUCKET/PREFIX or s3://BUCKET/PREFIX/FILE.gguf",
    )
    parser.add_argument("dest", type=Path, help="folder to download into (created if missing)")
    parser.add_argument(
        "--revision", default="main", help="branch, tag or commit (hf:// only; default: main)"
    )
    parser.add_argument(
        "--token-file", type=Path, help="file holding a Hugging Face token (default: $HF_TOKEN)"
    )
    parser.add_argument(
        "--retries", type=int, default=5, help="retries per file after network errors (default: 5)"
    )
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=5.0,
        help="seconds between progress lines (default: 5)",
    )
    parser.set_defaults(func=_run)


def _download(args: argparse.Namespace) -> None:
    from inflight.download.fetch import Options, download

    options = Options(retries=args.retries, progress_interval=args.progress_interval)
    source: str = args.source
    if source.startswith("hf://"):
        import httpx

        from inflight.download.hub import HubSource, parse_hf_source, read_token

        location = parse_hf_source(source)
        token = read_token(args.token_file)
        timeout = httpx.Timeout(30.0, read=60.0)
        with httpx.Client(follow_redirects=True, timeout=timeout) as client:
            hub = HubSource(location, args.revision, token, client)
            download(hub, f"{source}@{args.revision}", args.dest, options)
    elif source.startswith("s3://"):
        from inflight.download.s3 import S3Source, s3_client

        download(S3Source(source, s3_client()), source, args.dest, options)
    else:
        raise DownloadError(ExitCode.USAGE, f"{source!r}: expected an hf:// or s3:// source")


def _run(args: argparse.Namespace) -> int:
    try:
        _download(args)
    except DownloadError as error:
        retry = "" if error.code in PERMANENT else " (retrying may help)"
        print(
            f"inflight download: {error.code.kind} (exit {int(error.code)}){retry}: {error.message}",
            file=sys.stderr,
        )
        return int(error.code)
    except KeyboardInterrupt:
        print("inflight download: interrupted; run again to resume", file=sys.stderr)
        return 130
    return 0
