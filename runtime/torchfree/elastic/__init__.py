"""The torch-free modules of runtime/elastic/ (failures and switches in memory): they import no torch, directly or
through anything they import. The modules that run on a device stay in runtime/elastic/."""
