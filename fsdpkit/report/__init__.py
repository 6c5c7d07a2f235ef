"""Reports drawn from run outputs: pictures for `fsdpkit report`."""
