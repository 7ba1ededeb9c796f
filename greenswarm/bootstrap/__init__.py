"""The bootstrap peer (the swarm's entry point and relay) and peer identities."""
