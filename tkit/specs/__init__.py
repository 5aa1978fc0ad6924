"""Op specs by family; see tkit.registry."""
