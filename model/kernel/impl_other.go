//go:build !amd64 || purego

package kernel

func selectImpl() *impl { return genericImpl }

// candidateImpls lists every implementation usable on this machine (for tests).
func candidateImpls() []*impl { return []*impl{genericImpl} }
