"""Running the fleet as local processes on one machine (`flotilla up`, end-to-end tests)."""
