"""cluster: many hosts on one machine, for real: network namespaces on a bridge, links shaped by the kernel.

plan.py       pure: (name, hosts, link) -> the cluster's namespaces, addresses, shaping and the exact
              `ip` / `tc` commands, in order; the state file's format; the isolation check
placement.py  pure: which cluster host each shard and worker of a run goes on
netns.py      plumbing: applies a plan with `ip` / `tc`, records it in a state file, undoes it
probe.py      measures a cluster's links: a raw TCP stream between two hosts, a host's eth0 counters
command.py    `psgd cluster up | status | exec | down`
"""
