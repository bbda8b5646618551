"""The roles: one side of the run put together with a transport, and the only package that does so.

  island.py       run_island: an island's round loop over gRPC, in process, or with no outer loop
  coordinator.py  run_coordinator: the coordinator's round loop, serving gRPC or an in-process exchange
"""
