"""What every feature shares at run time: the knob table (``knobs``), device facts (``device``), the on-device
self-test memo (``selftests``) and the hardware policy (``policy``)."""
