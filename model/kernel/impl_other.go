//go:build !amd64 || purego

package kernel

func selectImpl() *impl { return genericImpl }

// candidateImpls lists every implementation usable on this machine (for tests).
func candidateImpls() []*impl { return []*impl{genericImpl} }

// hasBF16Impl reports whether the tests can run the AVX512_BF16 kernels here.
func hasBF16Impl() bool { return false }

func dotBF16Probe(acc *float32, a, b *uint32)   { panic("no AVX512_BF16") }
func toPairsAVX512(dst []uint32, src []float32) { panic("no AVX512_BF16") }
