package e2b

// The Handler's parts: each serves one group of routes and reaches the
// shared state through the Handler it belongs to. A part is a value made
// where it is used (filesystemAPI{h}.stat): it holds nothing of its own.

// filesystemAPI is envd's filesystem service and its /files transfers,
// through sandbox.FileSession.
type filesystemAPI struct{ h *Handler }
