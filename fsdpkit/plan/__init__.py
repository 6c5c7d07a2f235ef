"""The step-time and memory predictor (`fsdpkit plan`): what a sharded run holds and how long
its step takes, computed before launch on a meta-device model, and the profile terms measured
on this machine (`plan.calibrate`)."""
