//go:build !amd64 || purego

package kernel

// int8PeakLoop returns the loop PeakInt8GOPS runs: none, int8 products are portable Go here.
func int8PeakLoop() func(n int) float64 { return nil }
