"""The sidecar daemon, in layers (each imports only from the layers before it; the
``tests/test_layers.py`` walk holds every module to it):

1. pure logic: descriptor plans, admission, the receive state machine (no asyncio, ZMQ,
   NIXL or threads; callers pass ``now``);
2. ports: the one typed door to the NIXL thread, the peer book;
3. I/O shells: the engine socket server, the peer client and server, the memory channel;
4. the app (``app.Sidecar``): builds the parts in order, owns the lifecycle.
"""

