package model

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// repoIDPattern matches a Hugging Face repo id such as "Qwen/Qwen3-0.6B".
var repoIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$`)

// resolveModelDir turns a model argument into a local directory: an existing directory as is, or a
// repo id's snapshot in the local Hugging Face hub cache — the one revision names (a branch or
// tag under refs/, or a commit hash under snapshots/), or with no revision refs/main's, else the
// newest. hubCache, if non-empty, is the only cache searched. It never touches the network.
func resolveModelDir(nameOrPath, hubCache, revision string) (string, error) {
	if st, err := os.Stat(nameOrPath); err == nil {
		if !st.IsDir() {
			return "", fmt.Errorf("%w: %s is a file, not a model directory", ErrModelNotFound, nameOrPath)
		}
		return nameOrPath, nil
	}
	looked := []string{fmt.Sprintf("local directory %q (does not exist)", nameOrPath)}
	if repoIDPattern.MatchString(nameOrPath) {
		caches := hubCacheDirs(hubCache)
		repoDir := "models--" + strings.ReplaceAll(nameOrPath, "/", "--")
		for _, c := range caches {
			dir := filepath.Join(c, repoDir)
			if revision != "" {
				if snap, ok := revisionDir(dir, revision); ok {
					return snap, nil
				}
				looked = append(looked, fmt.Sprintf("revision %q in %s", revision, dir))
				continue
			}
			if snap, ok := snapshotDir(dir); ok {
				return snap, nil
			}
			looked = append(looked, filepath.Join(dir, "snapshots"))
		}
	}
	return "", fmt.Errorf("%w: %q: looked in %s; kvbridge never downloads models — fetch it first "+
		"(e.g. `huggingface-cli download %s`), pass a local directory, or use a built-in model "+
		"(`kvbridge serve kvbridge/small`, or kvbridge/tiny)",
		ErrModelNotFound, nameOrPath, strings.Join(looked, ", "), nameOrPath)
}

// hubCacheDirs lists the hub cache directories to search, in Hugging Face's order of precedence,
// without duplicates.
func hubCacheDirs(override string) []string {
	if override != "" {
		return []string{override}
	}
	var dirs []string
	add := func(d string) {
		if d != "" && !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	add(os.Getenv("HF_HUB_CACHE"))
	add(os.Getenv("HUGGINGFACE_HUB_CACHE"))
	if h := os.Getenv("HF_HOME"); h != "" {
		add(filepath.Join(h, "hub"))
	}
	if x := os.Getenv("XDG_CACHE_HOME"); x != "" {
		add(filepath.Join(x, "huggingface", "hub"))
	}
	if home, err := os.UserHomeDir(); err == nil {
		add(filepath.Join(home, ".cache", "huggingface", "hub"))
	}
	return dirs
}

// snapshotDir picks the snapshot of a cached repo: the revision named by refs/main if that
// snapshot exists, otherwise the most recently modified snapshot holding a config.json.
func snapshotDir(repoDir string) (string, bool) {
	snaps := filepath.Join(repoDir, "snapshots")
	if ref, err := os.ReadFile(filepath.Join(repoDir, "refs", "main")); err == nil {
		rev := strings.TrimSpace(string(ref))
		if rev != "" && !strings.ContainsAny(rev, `/\`) {
			d := filepath.Join(snaps, rev)
			if fileExists(filepath.Join(d, "config.json")) {
				return d, true
			}
		}
	}
	entries, err := os.ReadDir(snaps)
	if err != nil {
		return "", false
	}
	best, bestTime := "", int64(0)
	for _, e := range entries {
		d := filepath.Join(snaps, e.Name())
		st, err := os.Stat(filepath.Join(d, "config.json"))
		if err != nil {
			continue
		}
		if t := st.ModTime().UnixNano(); best == "" || t > bestTime {
			best, bestTime = d, t
		}
	}
	return best, best != ""
}

// revisionDir returns the snapshot of revision in a cached repo: snapshots/<revision> (a commit
// hash), or the commit refs/<revision> (a branch or tag) names.
func revisionDir(repoDir, revision string) (string, bool) {
	if strings.Contains(revision, "..") || strings.HasPrefix(revision, "/") {
		return "", false
	}
	snaps := filepath.Join(repoDir, "snapshots")
	if d := filepath.Join(snaps, revision); !strings.ContainsAny(revision, `/\`) && fileExists(filepath.Join(d, "config.json")) {
		return d, true
	}
	ref, err := os.ReadFile(filepath.Join(repoDir, "refs", filepath.FromSlash(revision)))
	if err != nil {
		return "", false
	}
	hash := strings.TrimSpace(string(ref))
	if hash == "" || strings.ContainsAny(hash, `/\`) {
		return "", false
	}
	d := filepath.Join(snaps, hash)
	return d, fileExists(filepath.Join(d, "config.json"))
}

// fileExists reports whether path exists (following symlinks, as the hub cache uses them).
func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
