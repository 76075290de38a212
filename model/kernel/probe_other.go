//go:build !amd64 || purego

package kernel

// readSideBySide has no kernels here: the probe reads its streams in turns (readStreams).
func readSideBySide([]float32, int) (float32, bool) { return 0, false }
