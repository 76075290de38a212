package model

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// loadDir loads a Hugging Face model directory: config.json, model.safetensors or a sharded
// model.safetensors.index.json, generation_config.json (optional), and from tokDir (dir itself
// unless --tokenizer names another) tokenizer.json, tokenizer_config.json (optional) and the
// chat template.
func loadDir(ctx context.Context, name, dir, tokDir string, opts OpenOptions) (*Model, error) {
	cfgData, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrModelNotFound, dir, err)
	}
	cfg, err := ParseConfig(cfgData)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	prec, err := parsePrecision(opts, cfg.DType)
	if err != nil {
		return nil, err
	}
	tok, err := loadTokenizer(tokDir)
	if err != nil {
		return nil, err
	}
	tmpl, err := chatTemplate(tokDir, tok)
	if err != nil {
		return nil, err
	}
	gen, err := loadGeneration(dir, cfg, tok)
	if err != nil {
		return nil, err
	}
	w, files, err := loadWeights(ctx, dir, cfg)
	if err != nil {
		files.close()
		return nil, err
	}
	m, err := buildModel(name, cfg, w, tok, tmpl, gen, prec)
	if err == nil {
		for _, f := range files {
			m.checkpointBytes += int64(len(f.mapped))
		}
	}
	if err != nil || m.tiedEmbed {
		files.close() // the packed model holds its own copy of everything
		return m, err
	}
	// An untied embedding is read from the mapping: the model keeps the files open, but gives
	// back the pages that packing faulted in, so that resident memory is the packed weights and
	// the embedding rows in use, not a second copy of the checkpoint.
	files.release()
	m.files = files
	return m, nil
}

// loadTokenizer reads tokenizer.json and tokenizer_config.json (optional).
func loadTokenizer(dir string) (*tokenizer.Tokenizer, error) {
	tj, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrModelNotFound, dir, err)
	}
	tcj, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("model: %s: %w", dir, err)
	}
	tok, err := tokenizer.Load(tj, tcj)
	if err != nil {
		return nil, fmt.Errorf("model: %s: %w", dir, err)
	}
	return tok, nil
}

// chatTemplate returns the model's chat template: tokenizer_config.json's chat_template, else
// the directory's chat_template.jinja, else ChatML.
func chatTemplate(dir string, tok *tokenizer.Tokenizer) (tokenizer.ChatTemplate, error) {
	if tok.ChatTemplateSource() == "" {
		if b, err := os.ReadFile(filepath.Join(dir, "chat_template.jinja")); err == nil && len(b) > 0 {
			t, err := tokenizer.ParseChatTemplate(string(b), tok.BOSToken(), tok.EOSToken())
			if err != nil {
				return nil, fmt.Errorf("model: %s/chat_template.jinja: %w", dir, err)
			}
			return t, nil
		}
	}
	t, err := tok.ChatTemplate()
	if err != nil {
		return nil, fmt.Errorf("model: %s: %w", dir, err)
	}
	return t, nil
}

// hfGeneration mirrors generation_config.json.
type hfGeneration struct {
	EOSTokenID  json.RawMessage `json:"eos_token_id"`
	Temperature *float64        `json:"temperature"`
	TopP        *float64        `json:"top_p"`
	TopK        *int            `json:"top_k"`
	MaxNew      *int            `json:"max_new_tokens"`
}

// loadGeneration reads generation_config.json (optional). EOS ids come from it, else from
// config.json, else from the tokenizer's eos_token. Embedding rows beyond the tokenizer's
// vocabulary are suppressed.
func loadGeneration(dir string, cfg Config, tok *tokenizer.Tokenizer) (GenerationConfig, error) {
	gen := GenerationConfig{Temperature: 1, TopP: 1}
	data, err := os.ReadFile(filepath.Join(dir, "generation_config.json"))
	switch {
	case err == nil:
		var h hfGeneration
		if err := json.Unmarshal(data, &h); err != nil {
			return gen, fmt.Errorf("%w: %s/generation_config.json: %w", ErrBadConfig, dir, err)
		}
		ids, err := tokenIDs(h.EOSTokenID)
		if err != nil {
			return gen, fmt.Errorf("%w: %s/generation_config.json: eos_token_id: %w", ErrBadConfig, dir, err)
		}
		gen.EOSTokenIDs = ids
		if h.Temperature != nil {
			gen.Temperature = *h.Temperature
		}
		if h.TopP != nil {
			gen.TopP = *h.TopP
		}
		if h.TopK != nil {
			gen.TopK = *h.TopK
		}
		if h.MaxNew != nil && *h.MaxNew > 0 {
			gen.MaxNewTokens = *h.MaxNew
		}
	case !errors.Is(err, fs.ErrNotExist):
		return gen, fmt.Errorf("model: %s: %w", dir, err)
	}
	if len(gen.EOSTokenIDs) == 0 {
		gen.EOSTokenIDs = slices.Clone(cfg.EOSTokenIDs)
	}
	if len(gen.EOSTokenIDs) == 0 {
		if id, ok := tok.EOSTokenID(); ok {
			gen.EOSTokenIDs = []int32{id}
		}
	}
	for id := tok.VocabSize(); id < cfg.VocabSize; id++ {
		gen.SuppressTokens = append(gen.SuppressTokens, int32(id))
	}
	return gen, nil
}

// safetensorsIndex mirrors model.safetensors.index.json.
type safetensorsIndex struct {
	WeightMap map[string]string `json:"weight_map"`
}

// mappedFiles are the safetensors files a load has open.
type mappedFiles map[string]*safetensors

// release drops the files' pages from this process's resident memory; the mappings stay valid
// (read-only and file-backed: a later read faults its page back in from the page cache).
func (fs mappedFiles) release() {
	for _, f := range fs {
		_ = unix.Madvise(f.mapped, unix.MADV_DONTNEED) // advisory: on failure the pages only stay resident
	}
}

// close unmaps every file.
func (fs mappedFiles) close() {
	for _, f := range fs {
		f.Close()
	}
}

// loadWeights finds every tensor cfg needs in model.safetensors or the sharded index. Vectors
// are widened to float32 now; matrices (the embedding and the projections) are left as views of
// the mapped files, read while being packed (or, an untied embedding, at every lookup). The
// caller closes the returned files when it no longer needs the views (also on error).
func loadWeights(ctx context.Context, dir string, cfg Config) (*weights, mappedFiles, error) {
	files := mappedFiles{}
	open := func(name string) (*safetensors, error) {
		if f, ok := files[name]; ok {
			return f, nil
		}
		if name != filepath.Base(name) {
			return nil, fmt.Errorf("%w: %s: shard name %q is not a plain file name", ErrBadWeights, dir, name)
		}
		f, err := openSafetensors(filepath.Join(dir, name))
		if err != nil {
			return nil, err
		}
		files[name] = f
		return f, nil
	}

	var lookup func(tensor string) (*safetensors, bool, error)
	if idx, err := os.ReadFile(filepath.Join(dir, "model.safetensors.index.json")); err == nil {
		var ix safetensorsIndex
		if err := json.Unmarshal(idx, &ix); err != nil {
			return nil, files, fmt.Errorf("%w: %s/model.safetensors.index.json: %w", ErrBadWeights, dir, err)
		}
		lookup = func(tensor string) (*safetensors, bool, error) {
			shard, ok := ix.WeightMap[tensor]
			if !ok {
				return nil, false, nil
			}
			f, err := open(shard)
			return f, err == nil, err
		}
	} else if errors.Is(err, fs.ErrNotExist) {
		f, err := open("model.safetensors")
		if err != nil {
			return nil, files, err
		}
		lookup = func(tensor string) (*safetensors, bool, error) {
			_, ok := f.tensors[tensor]
			return f, ok, nil
		}
	} else {
		return nil, files, fmt.Errorf("model: %s: %w", dir, err)
	}

	w := new(weights)
	for _, s := range w.specs(cfg) {
		if err := ctx.Err(); err != nil {
			return nil, files, err
		}
		f, ok, err := lookup(s.name)
		if err != nil {
			return nil, files, err
		}
		if !ok {
			if s.optional {
				continue
			}
			return nil, files, fmt.Errorf("%w: %s in %s", ErrMissingTensor, s.name, dir)
		}
		var shape []int
		if s.mat != nil {
			*s.mat, shape, err = f.matrix(s.name)
		} else {
			*s.vec, shape, err = f.float32s(s.name)
		}
		if err != nil {
			return nil, files, err
		}
		if s.scalar && len(shape) <= 1 && len(*s.vec) == 1 {
			continue
		}
		if !slices.Equal(shape, s.shape) {
			return nil, files, fmt.Errorf("%w: %s: tensor %s has shape %v, config wants %v", ErrBadWeights, dir, s.name, shape, s.shape)
		}
	}
	return w, files, nil
}
