"""The sharding plan that both wings write into generated code: the communication schedule."""
