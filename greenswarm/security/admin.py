"""``greenswarm swarm init|admit|id|check``: admission, on the operator's side and the site's."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from greenswarm.security.certificates import (
    create_authority,
    issue,
    load_authority_public,
    parse_validity,
    verify,
)
from greenswarm.timefmt import utc_second


def run_swarm_command(args: argparse.Namespace) -> int:
    if args.swarm_command == "init":
        key, public = create_authority(args.key)
        result = {"key": str(key), "public": str(public)}
        text = f"authority key: {key} (keep it private)\ngive sites its public half: {public}"
    elif args.swarm_command == "id":
        from greenswarm.bootstrap.identity import load_or_create_identity

        peer_id = load_or_create_identity(args.identity)
        result = {"identity": args.identity, "peer_id": peer_id}
        text = f"{peer_id}\n(send this peer id to the swarm's operator; keep {args.identity} private)"
    elif args.swarm_command == "admit":
        membership = issue(
            args.key,
            swarm=args.swarm,
            site=args.site,
            region=args.region,
            peer_id=args.peer_id,
            valid_s=parse_validity(args.expires),
            out=args.out,
            max_tokens_per_s=args.max_tokens_per_s,
        )
        result = {"certificate": args.out, **asdict(membership)}
        until = utc_second(membership.expires)
        text = f"{args.out}: {membership.site} ({membership.region}) admitted until {until}"
        if membership.max_tokens_per_s is not None:
            text += f", claiming at most {membership.max_tokens_per_s:g} tokens/s in a round"
    else:
        membership = verify(
            args.certificate,
            load_authority_public(args.authority),
            swarm=args.swarm,
            peer_id=args.peer_id,
        )
        result = {"valid": True, **asdict(membership)}
        text = (
            f"{args.certificate}: valid; {membership.site} ({membership.region}) in swarm "
            f"'{membership.swarm}', peer {membership.peer_id}, until {utc_second(membership.expires)}"
        )
    print(json.dumps(result) if args.json else text)
    return 0
