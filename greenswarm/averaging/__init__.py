"""Outer optimization across sites: the DiLoCo/FedAvg outer step and the swarm averager."""
