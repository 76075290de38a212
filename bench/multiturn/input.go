package multiturn

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// Input is a loaded --input-file.
type Input struct {
	// Conversations in file order (generated ones in id order).
	Conversations []Conversation
	// Gen is the generator config, nil for a ShareGPT list.
	Gen *GenConfig
	// Notices are things the user should know (substituted text files, reused text).
	Notices []string
}

// ReadInput reads the benchmark input: a ShareGPT-style list (a JSON array) or a generator config
// (a JSON object whose "filetype" is "generate_conversations"), whose conversations it then
// generates with tc and seed.
//
// A relative name in text_files is looked up next to the input file first, then in the current
// directory. A file found in neither place is replaced by DefaultText (the embedded public-domain
// text) and a notice says so, so that vLLM's own generate_multi_turn.json ("pg1184.txt") runs
// without downloads.
func ReadInput(path string, tc *TokenCounter, seed int64) (*Input, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading input file: %w", err)
	}
	trimmed := bytes.TrimSpace(data)
	switch {
	case len(trimmed) > 0 && trimmed[0] == '[':
		convs, err := ParseShareGPT(trimmed)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		return &Input{Conversations: convs}, nil
	case len(trimmed) > 0 && trimmed[0] == '{':
		cfg, err := ParseGenConfig(trimmed)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		in := &Input{Gen: cfg}
		text, notices, err := readTexts(filepath.Dir(path), cfg.TextFiles)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		in.Notices = notices
		g, err := Generate(cfg, text, tc, seed)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if g.Wrapped {
			in.Notices = append(in.Notices, fmt.Sprintf("the text files hold %d tokens, fewer than the generated conversations need: text was reused from its start (add text_files for more variety)", g.CorpusTokens))
		}
		in.Conversations = g.Conversations
		return in, nil
	}
	return nil, fmt.Errorf("%w: %s: want a JSON list of conversations or a generator config object", ErrConfig, path)
}

// readTexts concatenates the text files, resolving relative names against dir and then the
// working directory; missing files are replaced by the embedded text.
func readTexts(dir string, names []string) (string, []string, error) {
	var (
		b       strings.Builder
		notices []string
	)
	for _, name := range names {
		candidates := []string{name}
		if !filepath.IsAbs(name) {
			candidates = []string{filepath.Join(dir, name), name}
		}
		found := false
		for _, p := range candidates {
			data, err := os.ReadFile(p)
			if errors.Is(err, fs.ErrNotExist) {
				continue
			}
			if err != nil {
				return "", nil, fmt.Errorf("text_files: %w", err)
			}
			b.Write(data)
			found = true
			break
		}
		if !found {
			notices = append(notices, fmt.Sprintf("text file %q not found (looked in %s): using %s instead", name, strings.Join(candidates, " and "), DefaultTextName))
			b.WriteString(DefaultText())
		}
	}
	return b.String(), notices, nil
}
