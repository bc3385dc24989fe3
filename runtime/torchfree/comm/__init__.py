"""The torch-free modules of runtime/comm/ (communication): they import no torch, directly or through anything they
import. The modules that run on a device stay in runtime/comm/."""
