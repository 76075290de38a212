//go:build !linux

package model

import "errors"

// pinThread restricts the calling OS thread to cpus: Linux only; none is accepted everywhere.
func pinThread(cpus []int) error {
	if len(cpus) == 0 {
		return nil
	}
	return errors.New("pinning threads to CPUs needs Linux")
}

// memoryDomain names the memory domain of cpus: one for every rank where threads are not pinned.
func memoryDomain([]int) string { return "" }
