"""Schedule rules for TVM's ``arm_cpu`` target key (aarch64 NEON/SVE)."""
