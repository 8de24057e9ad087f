"""Schedule rules for TVM's ``cpu`` target key (x86-64 hosts)."""
